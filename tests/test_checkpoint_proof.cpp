// A checkpoint loads only if it proves itself, and checkpoints stream at any size (issue 16):
// an edited meta.json (a CRC32 entry deleted, shard files swapped, impossible or missing
// counters) is exit 3 with one line naming the file and key, for the loader and `checkpoint
// info` alike; a 3 GB checkpoint is written and read with little extra memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <regex>

#include <nlohmann/json.hpp>

#include "test_util.h"

using namespace lockstep;
using json = nlohmann::json;
using test::CliRun;
using test::Launcher;

namespace {

std::string job(const std::string& dir, int steps, const std::string& extra = "") {
  return "train --job.dump_folder " + dir + " --training.steps " + std::to_string(steps) +
         " --model.dim 32 --model.n_heads 2 --model.n_layers 1 --model.max_seq_len 32"
         " --training.seq_len 32 --training.local_batch_size 4 --training.threads 1"
         " --checkpoint.interval 4 --metrics.log_freq 1 " + extra;
}

// A copy of `run`'s step-4 checkpoint in a fresh run folder, its meta.json edited by `edit`.
std::string edited_copy(const std::string& run, const std::string& to,
                        const std::function<void(json&)>& edit) {
  std::filesystem::create_directories(to + "/checkpoint");
  std::filesystem::copy(run + "/checkpoint/step-4", to + "/checkpoint/step-4",
                        std::filesystem::copy_options::recursive);
  const std::string path = to + "/checkpoint/step-4/meta.json";
  json meta = json::parse(test::read_text(path));
  edit(meta);
  test::write_bytes(path, meta.dump(2));
  return to;
}

// The resume and `checkpoint info` both refuse with exit 3 and one line holding `expected`.
void expect_refused(const std::string& copy, const std::string& extra, const std::string& expected,
                    Launcher launcher = Launcher::kLockstepRun, int world = 1) {
  const std::string args = job(copy, 8, extra);
  const CliRun r = world == 1 ? test::run_lockstep(args) : test::run_on_ranks(world, args, launcher);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(expected), std::string::npos) << r.out;
  // `checkpoint info`: the same check, as its last line (a tensor's problem follows the table).
  const CliRun info = test::run_lockstep("checkpoint info " + copy + "/checkpoint");
  EXPECT_EQ(info.code, 3) << info.out;
  const std::string last = info.out.substr(info.out.rfind('\n', info.out.size() - 2) + 1);
  EXPECT_NE(last.find(expected), std::string::npos) << info.out;
}

}  // namespace

TEST(CheckpointProof, EditedMetaJsonIsRefusedNamingTheKey) {
  test::TempDir dir;
  const std::string run = dir / "run";
  ASSERT_EQ(test::run_lockstep(job(run, 4)).code, 0);
  expect_refused(edited_copy(run, dir / "crc", [](json& m) {
                   m["checksums"]["model.safetensors"].erase("wte.weight");
                 }),
                 "", "tensor 'wte.weight' has no CRC32 in meta.json");
  expect_refused(edited_copy(run, dir / "step", [](json& m) { m["step"] = 3; }), "",
                 "key 'step' is 3 in folder step-4");
  expect_refused(edited_copy(run, dir / "neg", [](json& m) { m["skipped_steps"] = -1; }), "",
                 "key 'skipped_steps' is -1, not an integer >= 0");
  expect_refused(edited_copy(run, dir / "gone", [](json& m) { m.erase("skipped_steps"); }), "",
                 "key 'skipped_steps' is missing");
  expect_refused(edited_copy(run, dir / "sum", [](json& m) { m["optimizer_steps"] = 3; }), "",
                 "key 'optimizer_steps' + skipped_steps + overflow_skips = 3 + 0 + 0, not the step 4");
  expect_refused(edited_copy(run, dir / "rng", [](json& m) { m.erase("rng"); }), "",
                 "key 'rng' is missing");
}

TEST(CheckpointProof, SwappedShardFilesAreRefused) {
  test::TempDir dir;
  const std::string run = dir / "run";
  CliRun r = test::run_on_ranks(2, job(run, 4, "--parallelism.mode sharded"), Launcher::kLockstepRun);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string copy = edited_copy(run, dir / "swap", [](json& m) {
    std::swap(m["optimizer_shards"][0]["file"], m["optimizer_shards"][1]["file"]);
  });
  r = test::run_on_ranks(2, job(copy, 8, "--parallelism.mode sharded"), Launcher::kLockstepRun);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("holds the range(s) 0+"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("files swapped"), std::string::npos) << r.out;
}

// A 3 GB checkpoint (a 2M-token embedding of width 128: 1 GiB of weights, 2 GiB of moments):
// saved streaming, with rank 0's resident memory growing by less than 10 % of the checkpoint
// while it writes, and read back memory-mapped; the run then resumes from it.
TEST(CheckpointProof, AThreeGigabyteCheckpointStreams) {
  test::TempDir dir;
  const std::string run = dir / "run";
  const std::string big =
      "train --job.dump_folder " + run + " --model.vocab_size 2097152 --model.dim 128"
      " --model.n_heads 2 --model.n_layers 1 --model.max_seq_len 8 --training.seq_len 8"
      " --training.local_batch_size 1 --training.threads 2 --lr_scheduler.warmup_steps 0"
      " --metrics.log_freq 1 --diagnostics.local_check false --checkpoint.keep_latest_k 0";
  CliRun r = test::run_lockstep(big + " --training.steps 1");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto bytes = [&](const char* f) {
    return std::filesystem::file_size(run + "/checkpoint/step-1/" + std::string(f));
  };
  const double ckpt_mib = static_cast<double>(bytes("model.safetensors") +
                                              bytes("optimizer.safetensors")) / 1048576.0;
  EXPECT_GT(ckpt_mib, 3000);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(checkpoint saved: \S+ \(([0-9.]+) s, peak resident memory \+([0-9]+) MiB\))")))
      << r.out;
  const double save_s = std::stod(m[1]), extra_mib = std::stod(m[2]);
  std::printf("3 GB checkpoint (%.0f MiB): saved in %.1f s, peak resident +%.0f MiB (%.1f %%)\n",
              ckpt_mib, save_s, extra_mib, 100 * extra_mib / ckpt_mib);
  EXPECT_LT(extra_mib, 0.1 * ckpt_mib);
  EXPECT_EQ(test::run_lockstep("checkpoint info " + run + "/checkpoint").code, 0);
  r = test::run_lockstep(big + " --training.steps 2");
  ASSERT_EQ(r.code, 0) << r.out;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(resumed from \S+ \(step 1, data position \d+; read in ([0-9.]+) s\))")))
      << r.out;
  std::printf("read back in %s s\n", m[1].str().c_str());
}
