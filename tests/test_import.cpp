// `lockstep import` and checkpoint.initial_load_path against Hugging Face transformers: a small
// random GPT-2 and Llama written by save_pretrained (tests/hf_make.py, offline, from the
// project's .venv) are read into lockstep's models, whose logits must equal transformers' on the
// same tokens (1e-5, as the export's test); reading them back out through the export's mapping
// gives the very same bytes; a run starts from the folder and a resume no longer reads it; a
// model lockstep cannot hold is refused naming the file and the key or tensor.
#include <ATen/ops/abs.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/max.h>
#include <ATen/ops/sub.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "checkpoint/safetensors.h"
#include "export/hf.h"
#include "lockstep/error.h"
#include "lockstep/tools.h"
#include "lockstep/train.h"
#include "model/model.h"
#include "run_util.h"

using namespace lockstep;
using lockstep::test::TempDir;

namespace {

// A random `kind` folder in dir/model and transformers' logits in dir/expected.safetensors.
void make_hf(const std::string& dir, const std::string& kind) {
  const auto r = test::capture(std::string(LOCKSTEP_PYTHON) + " " LOCKSTEP_SOURCE_DIR
                               "/tests/hf_make.py " + dir + " " + kind);
  ASSERT_EQ(r.code, 0) << r.out << "(transformers must be installed in " << LOCKSTEP_PYTHON
                       << ": run launch/test.sh)";
}

// A random llama folder in dir/model and what `lockstep import` prints for it, in
// dir/finetune.toml (returned).
std::string imported_llama(const TempDir& dir) {
  make_hf(dir.path(), "llama");
  const std::string cfg = dir / "finetune.toml";
  const auto printed = test::run_lockstep("import " + (dir / "model"));
  EXPECT_EQ(printed.code, 0) << printed.out;
  std::ofstream(cfg) << printed.out;
  return cfg;
}

at::Tensor tensor_of(const TensorView& v) {
  return at::from_blob(const_cast<char*>(v.data), v.shape, v.dtype).clone();
}

void imports_as_transformers_computes(const std::string& kind) {
  TempDir dir;
  make_hf(dir.path(), kind);
  const Config c = load_config(import_hf(dir / "model"), "import.toml");
  EXPECT_EQ(c.checkpoint.initial_load_path,
            std::filesystem::absolute(dir / "model").lexically_normal().string());
  const std::unique_ptr<Model> model = make_model(c.model, 1, c10::Device(c10::kCPU));
  load_hf_weights(dir / "model", c.model, model->parameters());
  MappedSafetensors want(dir / "expected.safetensors");
  const at::Tensor logits = model->forward(tensor_of(want.at("input_ids")), /*train=*/false);
  const double diff =
      at::max(at::abs(at::sub(logits, tensor_of(want.at("logits"))))).item<double>();
  std::cout << kind << ": max |lockstep - transformers| logit = " << diff << "\n";
  EXPECT_LE(diff, 1e-5);
  // Back out through the export's mapping: every tensor transformers saved, bit for bit.
  std::map<std::string, std::vector<char>> saved;
  for (const auto& f : std::filesystem::directory_iterator(dir / "model"))
    if (f.path().extension() == ".safetensors") {
      MappedSafetensors file(f.path().string());
      for (const auto& [name, v] : file.tensors()) saved[name].assign(v.data, v.data + v.bytes);
    }
  const std::vector<NamedTensor> back = to_hf(c.model, model->parameters());
  for (const NamedTensor& t : back) {
    const std::vector<char>& v = saved.at(t.name);
    ASSERT_EQ(v.size(), static_cast<size_t>(t.tensor.numel()) * 4) << t.name;
    EXPECT_EQ(std::memcmp(v.data(), t.tensor.data_ptr(), v.size()), 0) << t.name;
  }
  EXPECT_EQ(back.size(), saved.size()) << "every saved tensor is a parameter's";
}

}  // namespace

TEST(Import, Gpt2GivesTransformersLogitsAndRoundTripsBitwise) {
  imports_as_transformers_computes("gpt2");
}

// Saved in shards (model.safetensors.index.json), as large models are.
TEST(Import, ShardedLlamaGivesTransformersLogitsAndRoundTripsBitwise) {
  imports_as_transformers_computes("llama-sharded");
}

// Llama 3.1 / 3.2 as they ship (issue 41): rope scaling of type "llama3" (a kept, a blended and
// scaled frequencies) and the head tied to the embedding (one tensor, stored once).
TEST(Import, Llama32WithLlama3RopeAndTiedEmbeddingsGivesTransformersLogitsAndRoundTrips) {
  imports_as_transformers_computes("llama3.2");
}

// A fine-tune: `lockstep import` prints the config, a run trains from the folder's weights (its
// first loss is the imported model's, not a fresh one's), and once the run has its own
// checkpoint a resume reads the checkpoint, not the folder (here: deleted).
TEST(Import, ARunStartsFromTheFolderAndAResumeDoesNotReadIt) {
  TempDir dir;
  const std::string cfg = imported_llama(dir);
  const std::string common = " --config " + cfg + " --training.steps 4 --training.seq_len 16 "
                             "--training.local_batch_size 2 --training.threads 1 "
                             "--metrics.log_freq 1 --checkpoint.interval 4 ";
  auto run = test::run_lockstep("train --job.dump_folder " + (dir / "tuned") + common);
  ASSERT_EQ(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("initial weights: " + std::filesystem::absolute(dir / "model")
                                                   .lexically_normal()
                                                   .string()),
            std::string::npos)
      << run.out;
  const auto fresh = test::run_lockstep("train --job.dump_folder " + (dir / "fresh") + common +
                                        "--checkpoint.initial_load_path ''");
  ASSERT_EQ(fresh.code, 0) << fresh.out;
  const auto tuned = test::outcome(dir / "tuned", 1), scratch = test::outcome(dir / "fresh", 1);
  ASSERT_FALSE(tuned.losses.empty());
  EXPECT_NE(tuned.losses[0], scratch.losses[0]) << "the first step used the imported weights";
  std::filesystem::remove_all(dir / "model");
  run = test::run_lockstep("train --job.dump_folder " + (dir / "tuned") + common +
                           "--training.steps 6");
  EXPECT_EQ(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("resumed from"), std::string::npos) << run.out;
}

// The printed config works with the line a user adds (issue 41): it names a run folder of its
// own (a second fine-tune never meets the first), sets nothing the data and validation lines
// conflict with, and a fine-tune started in another model's folder is told so.
TEST(Import, EachFineTuneHasItsOwnFolderAndTakesTheDataLine) {
  TempDir dir;
  make_hf(dir / "a", "gpt2");
  make_hf(dir / "b", "llama");
  std::filesystem::rename(dir / "a/model", dir / "hf_gpt2");
  std::filesystem::rename(dir / "b/model", dir / "hf_llama");
  ASSERT_EQ(test::run_lockstep("data shard " + (dir / "data") + " --from " LOCKSTEP_SOURCE_DIR
                               "/README.md").code, 0);
  std::ofstream(dir / "gpt2.toml") << test::run_lockstep("import " + (dir / "hf_gpt2")).out;
  std::ofstream(dir / "llama.toml") << test::run_lockstep("import " + (dir / "hf_llama")).out;
  const std::string toml = test::read_text(dir / "gpt2.toml");
  EXPECT_NE(toml.find("dump_folder = './outputs/finetune-hf_gpt2'"), std::string::npos) << toml;
  for (const char* absent : {"[data]", "[validation]", "source =", "enable ="})
    EXPECT_EQ(toml.find(absent), std::string::npos) << absent << "\n" << toml;
  const std::string line = " --data.path '" + (dir / "data") + "/train_*.bin' "
                           "--validation.dataset_path '" + (dir / "data") + "/val_*.bin' "
                           "--training.steps 2 --training.threads 1 --validation.steps 1 "
                           "--checkpoint.interval 2";
  for (const char* name : {"gpt2", "llama"}) {
    const auto r = test::capture("cd " + dir.path() + " && " LOCKSTEP_BIN " train --config " +
                                 name + ".toml" + line);
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("validation"), std::string::npos) << r.out;
  }
  EXPECT_TRUE(std::filesystem::exists(dir / "outputs/finetune-hf_gpt2/checkpoint/step-2"));
  EXPECT_TRUE(std::filesystem::exists(dir / "outputs/finetune-hf_llama/checkpoint/step-2"));
  const auto other = test::capture("cd " + dir.path() + " && " LOCKSTEP_BIN
                                   " train --config llama.toml --job.dump_folder "
                                   "outputs/finetune-hf_gpt2" + line);
  EXPECT_EQ(other.code, 3) << other.out;
  EXPECT_NE(other.out.find("holds checkpoints of another model (model.dim 48 -> 64"),
            std::string::npos)
      << other.out;
}

TEST(Import, RefusesAnotherArchitectureAnotherModelAndAShapeThatDiffers) {
  TempDir dir;
  make_hf(dir / "bert", "bert");
  auto r = test::run_lockstep("import " + (dir / "bert/model"));
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("config.json: model_type 'bert' is not a model lockstep trains"),
            std::string::npos)
      << r.out;
  make_hf(dir / "gpt", "gpt2");
  const std::string folder = dir / "gpt/model";
  // A run whose [model] is not the folder's is refused naming the key, before anything runs.
  r = test::run_lockstep("train --job.dump_folder " + (dir / "run") +
                         " --model.dim 64 --checkpoint.initial_load_path " + folder);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("invalid value for 'model.dim': checkpoint.initial_load_path = '" +
                       folder + "' holds another model (48 there, 64 here)"),
            std::string::npos)
      << r.out;
  // Weights that disagree with their own config: the tensor is named with both shapes.
  ModelConfig m = model_config_from_hf(folder);
  m.vocab_size = 300;
  const std::unique_ptr<Model> model = make_model(m, 1, c10::Device(c10::kCPU));
  try {
    load_hf_weights(folder, m, model->parameters());
    ADD_FAILURE() << "a shape that differs was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'transformer.wte.weight' has shape [256, 48]; "
                                         "lockstep's wte.weight needs [300, 48]"),
              std::string::npos)
        << e.what();
  }
}

// Every weight is checked where it enters (issue 42): a tensor stored as integers (it was cast
// and trained) or holding a NaN is refused naming it; a damaged file gets the advice for a
// downloaded model, not a checkpoint's.
TEST(Import, RefusesIntegerOrNonfiniteWeightsAndADamagedFileNamingThem) {
  TempDir dir;
  make_hf(dir.path(), "gpt2");
  const std::string folder = dir / "model";
  const std::string file = folder + "/model.safetensors";
  const ModelConfig m = model_config_from_hf(folder);
  const std::unique_ptr<Model> model = make_model(m, 1, c10::Device(c10::kCPU));
  const auto rewrite = [&](const std::string& change) {
    const auto r = test::capture(std::string(LOCKSTEP_PYTHON) +
                                 " -c \"import torch; from safetensors.torch import load_file, "
                                 "save_file; t = load_file('" + file + "'); " + change +
                                 "; save_file(t, '" + file + "', metadata={'format': 'pt'})\"");
    ASSERT_EQ(r.code, 0) << r.out;
  };
  const auto refused = [&](const std::string& expect) {
    try {
      load_hf_weights(folder, m, model->parameters());
      ADD_FAILURE() << "accepted: " << expect;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << e.what();
    }
  };
  rewrite("t['transformer.h.0.ln_1.weight'][3] = float('nan')");
  refused("tensor 'transformer.h.0.ln_1.weight' holds 1 nonfinite value;");
  rewrite("t['transformer.h.0.ln_1.weight'] = t['transformer.h.0.ln_1.weight'].nan_to_num()"
          ".to(torch.int32)");
  refused("tensor 'transformer.h.0.ln_1.weight' is stored as Int; lockstep loads weights stored "
          "as floating point");
  std::filesystem::resize_file(file, 100);
  refused("Hugging Face weights file '" + file + "' is corrupt or truncated");
}

// fsdp reads the folder into each unit as the model is drawn, before sharding it (the model is
// never whole on a rank): the run is the sharded one's from the same folder, bit for bit.
TEST(Import, FsdpStartsFromTheFolderUnitByUnit) {
  TempDir dir;
  const std::string cfg = imported_llama(dir);
  const std::string common = " --config " + cfg + " --training.steps 3 --training.seq_len 16 "
                             "--training.local_batch_size 2 --training.threads 1 "
                             "--metrics.log_freq 1 --checkpoint.enable false ";
  std::map<std::string, test::RunOutcome> got;
  for (const char* mode : {"sharded", "fsdp"}) {
    const auto r = test::run_on_ranks(2, "train --job.dump_folder " + (dir / mode) + common +
                                             "--parallelism.mode " + mode,
                                      test::Launcher::kLockstepRun);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("initial weights: "), std::string::npos) << r.out;
    got[mode] = test::outcome(dir / mode, 2);
  }
  ASSERT_EQ(got["fsdp"].losses.size(), 3u);
  EXPECT_EQ(got["fsdp"].losses, got["sharded"].losses);
  EXPECT_EQ(got["fsdp"].crcs, got["sharded"].crcs);
}
