#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "checkpoint/checkpointer.h"
#include "checkpoint/meta.h"
#include "lockstep/config.h"
#include "lockstep/error.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "test_util.h"

using namespace lockstep;
using json = nlohmann::json;

namespace {

ModelConfig tiny() {
  ModelConfig m;
  m.dim = 16;
  m.n_layers = 1;
  m.n_heads = 2;
  m.max_seq_len = 8;
  return m;
}

json config_json(const ModelConfig& m) {
  Config c;
  c.model = m;
  return json::parse(to_json(c));
}

// A model and optimizer with non-trivial state (one real step).
struct Job {
  Gpt model;
  AdamW opt;
  explicit Job(uint64_t seed, ModelConfig m = tiny())
      : model(m, seed, c10::Device(c10::kCPU)), opt(model.parameters(), {}) {
    for (const auto& p : model.parameters()) p.tensor.mutable_grad() = at::randn(p.tensor.sizes());
    opt.step(1e-2);
  }
};

// Saves `job` as step `step` (other counters zero).
void save_step(const Checkpointer& ck, Job& job, int64_t step) {
  TrainState st;
  st.step = step;
  st.optimizer_steps = step;
  ck.save(st, job.model.parameters(), job.opt.state(), config_json(tiny()));
}

void expect_same(const std::vector<NamedTensor>& a, const std::vector<NamedTensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].name, b[i].name);
    EXPECT_TRUE(at::equal(a[i].tensor, b[i].tensor)) << a[i].name;
  }
}

std::string load_error(const Checkpointer& ck, int64_t step, Job& into, const json& cfg) {
  try {
    ck.load(step, into.model.parameters(), into.opt.state(), cfg);
  } catch (const InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an InputError";
  return "";
}

void flip_byte(const std::string& path, std::streamoff from_end) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-from_end, std::ios::end);
  char c;
  f.get(c);
  f.seekp(-from_end, std::ios::end);
  f.put(static_cast<char>(c ^ 0x5a));
}

}  // namespace

TEST(Checkpoint, RoundTripIsBitwise) {
  test::TempDir dir;
  Checkpointer ck({dir / "ckpt", 0});
  Job a(1), b(2);
  TrainState s{7, 6, 112, 7168, 1, 1};  // 6 updates + 1 skip = 7 steps
  ck.save(s, a.model.parameters(), a.opt.state(), config_json(tiny()));
  EXPECT_EQ(ck.steps(), std::vector<int64_t>{7});
  TrainState got = ck.load(7, b.model.parameters(), b.opt.state(), config_json(tiny()));
  EXPECT_EQ(got.step, 7);
  EXPECT_EQ(got.optimizer_steps, 6);
  EXPECT_EQ(got.data_position, 112);
  EXPECT_EQ(got.tokens_seen, 7168);
  expect_same(a.model.parameters(), b.model.parameters());
  expect_same(a.opt.state(), b.opt.state());
}

TEST(Checkpoint, KeepLatestK) {
  test::TempDir dir;
  Checkpointer ck({dir / "ckpt", 2});
  Job a(1);
  for (int64_t s : {10, 20, 30, 40}) save_step(ck, a, s);
  EXPECT_EQ(ck.steps(), (std::vector<int64_t>{30, 40}));
  EXPECT_FALSE(std::filesystem::exists(dir / "ckpt/step-10"));
}

TEST(Checkpoint, InterruptedWriteIsIgnored) {
  // What a kill during save leaves behind: a temporary folder, and a step folder without
  // meta.json (meta.json is written last). Neither may count as a checkpoint.
  test::TempDir dir;
  Checkpointer ck({dir / "ckpt", 0});
  Job a(1), b(2);
  save_step(ck, a, 5);
  std::filesystem::create_directories(dir / "ckpt/step-10.tmp-1234");
  test::write_bytes(dir / "ckpt/step-10.tmp-1234/model.safetensors", "partial");
  std::filesystem::create_directories(dir / "ckpt/step-15");
  test::write_bytes(dir / "ckpt/step-15/model.safetensors", "partial");
  EXPECT_EQ(ck.steps(), std::vector<int64_t>{5});
  EXPECT_EQ(ck.load(5, b.model.parameters(), b.opt.state(), config_json(tiny())).step, 5);
  expect_same(a.model.parameters(), b.model.parameters());
}

TEST(Checkpoint, CorruptTensorFailsItsChecksum) {
  test::TempDir dir;
  Checkpointer ck({dir / "ckpt", 0});
  Job a(1), b(2);
  save_step(ck, a, 3);
  flip_byte(dir / "ckpt/step-3/model.safetensors", 3);
  std::string m = load_error(ck, 3, b, config_json(tiny()));
  EXPECT_NE(m.find("CRC32"), std::string::npos) << m;
  EXPECT_NE(m.find("model.safetensors"), std::string::npos) << m;
  json info = checkpoint_info(dir / "ckpt");
  int bad = 0;
  for (const auto& t : info["tensors"]) bad += t["ok"].get<bool>() ? 0 : 1;
  EXPECT_EQ(bad, 1);
}

TEST(Checkpoint, TruncatedFile) {
  test::TempDir dir;
  Checkpointer ck({dir / "ckpt", 0});
  Job a(1), b(2);
  save_step(ck, a, 3);
  std::filesystem::resize_file(dir / "ckpt/step-3/optimizer.safetensors", 100);
  std::string m = load_error(ck, 3, b, config_json(tiny()));
  EXPECT_NE(m.find("corrupt or truncated"), std::string::npos) << m;
  std::filesystem::resize_file(dir / "ckpt/step-3/optimizer.safetensors", 4);
  m = load_error(ck, 3, b, config_json(tiny()));
  EXPECT_NE(m.find("corrupt or truncated"), std::string::npos) << m;
}

TEST(Checkpoint, OtherModelConfigIsRejected) {
  test::TempDir dir;
  Checkpointer ck({dir / "ckpt", 0});
  Job a(1);
  save_step(ck, a, 3);
  ModelConfig wide = tiny();
  wide.dim = 32;
  Job b(2, wide);
  std::string m = load_error(ck, 3, b, config_json(wide));
  EXPECT_NE(m.find("holds another model (model.dim 16 -> 32)"), std::string::npos) << m;
}

// A checkpoint written before a [model] key existed resumes when the run keeps that key's
// default (issue 41's rope and tie keys), and is another model when the run sets it.
TEST(Checkpoint, AModelKeyTheCheckpointLacksCountsAsItsDefault) {
  nlohmann::json saved = nlohmann::json::parse(to_json(default_config()));
  saved["model"].erase("tie_embeddings");
  saved["model"]["dropout"] = 0.3;
  Config now = default_config();
  EXPECT_TRUE(model_differences(saved, nlohmann::json::parse(to_json(now))).empty());
  now.model.tie_embeddings = true;
  const auto d = model_differences(saved, nlohmann::json::parse(to_json(now)));
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0], "model.tie_embeddings false -> true");
}

TEST(Checkpoint, InfoOnNonCheckpoint) {
  test::TempDir dir;
  EXPECT_THROW(checkpoint_info(dir.path()), InputError);
  test::write_bytes(dir / "meta.json", "{not json");
  EXPECT_THROW(checkpoint_info(dir.path()), InputError);
}
