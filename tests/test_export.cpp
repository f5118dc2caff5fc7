// `lockstep export` against an independent implementation of the same maths: a short run's
// checkpoint is exported, Hugging Face transformers (from PyPI, in the project's .venv) loads
// the folder offline, and its logits, loss and every parameter's gradient on the same tokens
// must match lockstep's (tests/hf_reference.py states the tolerances). Plus `generate` and the
// export's refusals.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randint.h>
#include <gtest/gtest.h>

#include "checkpoint/model_loader.h"
#include "checkpoint/safetensors.h"
#include "export/hf.h"
#include "lockstep/error.h"
#include "lockstep/tools.h"
#include "lockstep/train.h"
#include "test_util.h"

using namespace lockstep;
using lockstep::test::TempDir;

namespace {

Config short_run(const ModelConfig& model, const std::string& run_dir) {
  Config c = default_config();
  c.model = model;
  c.training.steps = 4;
  c.training.local_batch_size = 4;
  c.training.seq_len = 16;
  c.job.dump_folder = run_dir;
  c.checkpoint.interval = 4;
  c.metrics.log_freq = 4;
  return c;
}

// What lockstep computes on `tokens` with the checkpoint's weights, in transformers' names.
void write_expected(const std::string& run_dir, const at::Tensor& tokens, const std::string& path) {
  const CheckpointedModel ckpt = load_checkpointed_model(run_dir, -1);
  const int64_t T = tokens.size(1) - 1;
  const at::Tensor idx = tokens.slice(1, 0, T), targets = tokens.slice(1, 1, T + 1);
  const at::Tensor logits = ckpt.model->forward(idx, /*train=*/false);
  const at::Tensor loss = sample_losses(logits, targets).mean();
  loss.backward();
  std::vector<NamedTensor> grads;
  for (const auto& p : ckpt.model->parameters()) grads.push_back({p.name, p.tensor.grad()});
  std::vector<NamedTensor> out = {{"input_ids", idx.contiguous()},
                                  {"targets", targets.contiguous()},
                                  {"logits", logits.detach().contiguous()},
                                  {"loss", loss.detach().reshape({1})}};
  for (auto& g : to_hf(ckpt.config.model, grads)) out.push_back({"grad." + g.name, g.tensor});
  SafetensorsWriter w(path, to_write(out));
  for (const auto& t : out) w.append(t.tensor);
  w.finish();
}

void matches_transformers(const ModelConfig& model) {
  TempDir dir;
  train(short_run(model, dir / "run"));
  std::cout << export_checkpoint(dir / "run", -1, "hf", dir / "hf") << "\n";
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  write_expected(dir / "run", at::randint(0, model.vocab_size, {3, 17}, gen), dir / "expected.safetensors");
  const auto r = test::capture(fmt::format("{} {}/tests/hf_reference.py {} {}", LOCKSTEP_PYTHON,
                                           LOCKSTEP_SOURCE_DIR, dir / "hf",
                                           dir / "expected.safetensors"));
  std::cout << r.out;
  EXPECT_EQ(r.code, 0) << "transformers disagrees with lockstep (or is not installed in "
                       << LOCKSTEP_PYTHON << ": run launch/test.sh)";
}

ModelConfig small(ModelName name) {
  ModelConfig m;
  m.name = name;
  m.vocab_size = 256;
  m.dim = 64;
  m.n_layers = 2;
  m.n_heads = 4;
  m.max_seq_len = 32;
  if (name == ModelName::kLlama) {
    m.n_kv_heads = 2;  // grouped-query attention
    m.multiple_of = 32;
    m.ffn_dim_multiplier = 1.3;
    m.rope_theta = 500000;
  }
  return m;
}

}  // namespace

TEST(Export, GptMatchesTransformersGpt2) { matches_transformers(small(ModelName::kGpt)); }

TEST(Export, LlamaMatchesTransformersLlama) { matches_transformers(small(ModelName::kLlama)); }

TEST(Export, RefusesAnExistingFolderAndAMissingStep) {
  TempDir dir;
  train(short_run(small(ModelName::kLlama), dir / "run"));
  std::filesystem::create_directories(dir / "taken");
  auto r = test::run_lockstep("export " + (dir / "run") + " " + (dir / "taken"));
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("exists; choose a new folder"), std::string::npos) << r.out;
  r = test::run_lockstep("export " + (dir / "run") + " " + (dir / "out") + " --step 3");
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("has no checkpoint of step 3; it has step 4"), std::string::npos) << r.out;
  EXPECT_FALSE(std::filesystem::exists(dir / "out"));
  r = test::run_lockstep("export " + (dir / "run") + " " + (dir / "out") + " --format gguf");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("use --format hf"), std::string::npos) << r.out;
}

TEST(Generate, ContinuesThePromptReproducibly) {
  TempDir dir;
  train(short_run(small(ModelName::kLlama), dir / "run"));
  const std::string cmd = "generate " + (dir / "run") + " --prompt 'the rank ' --tokens 24 --seed 3";
  const auto a = test::run_lockstep(cmd), b = test::run_lockstep(cmd);
  ASSERT_EQ(a.code, 0) << a.out;
  EXPECT_EQ(a.out.rfind("the rank ", 0), 0u) << a.out;
  EXPECT_EQ(a.out.size(), std::string("the rank ").size() + 24 + 1) << a.out;  // + newline
  EXPECT_EQ(a.out, b.out);  // the same seed samples the same text
  const auto c = test::run_lockstep("generate " + (dir / "run") + " --tokens 24 --seed 4");
  EXPECT_EQ(c.code, 0) << c.out;
  // The run folder without its config.toml: its checkpoint/ is found all the same (it said "no
  // checkpoint"); an empty folder is named as holding neither (issue 42).
  std::filesystem::remove(dir / "run/config.toml");
  EXPECT_EQ(test::run_lockstep(cmd).out, a.out);
  std::filesystem::create_directories(dir / "empty");
  const auto e = test::run_lockstep("generate " + (dir / "empty") + " --tokens 4");
  EXPECT_EQ(e.code, 3) << e.out;
  EXPECT_NE(e.out.find("holds no checkpoint and no config.toml"), std::string::npos) << e.out;
}
