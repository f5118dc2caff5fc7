// The data-parallel modes across processes: sharded (ZeRO-2) against ddp and one rank,
// sharded checkpoints resumed at other world sizes and in the other mode, damaged shards, and
// a save that runs out of disk.
#include <gtest/gtest.h>
#include <sys/mount.h>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "test_util.h"

using namespace lockstep;
using json = nlohmann::json;
using test::CliRun;
using test::Launcher;
using test::read_text;

namespace {

// `lockstep train` on a small model; the run directory and step count vary.
std::string train_args(const std::string& dir, int steps, const std::string& extra = "") {
  return "train --job.dump_folder " + dir + " --training.steps " + std::to_string(steps) +
         " --model.dim 32 --model.n_heads 2 --model.n_layers 2 --model.max_seq_len 32"
         " --training.seq_len 32 --training.threads 1 --metrics.log_freq 1"
         " --lr_scheduler.warmup_steps 3 " + extra;
}


// The same training, up to summation order: every step's loss, and its gradient norm (which
// a wrong 1/W in the average would change while AdamW keeps the losses nearly the same).
void expect_same_run(const test::RunOutcome& got, const test::RunOutcome& want,
                     const std::string& what, size_t from = 0) {
  ASSERT_EQ(got.losses.size() + from, want.losses.size()) << what;
  ASSERT_EQ(got.grad_norms.size() + from, want.grad_norms.size()) << what;
  for (size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[from + i], 1e-4) << what << ", step " << from + i + 1;
    EXPECT_NEAR(got.grad_norms[i], want.grad_norms[from + i], 1e-4 * want.grad_norms[from + i])
        << what << ", grad_norm of step " << from + i + 1;
  }
}

// Copies step-N of `from`'s checkpoints into a fresh run directory `to`.
void seed_checkpoint(const std::string& from, int step, const std::string& to) {
  std::filesystem::create_directories(to + "/checkpoint");
  std::filesystem::copy(from + "/checkpoint/step-" + std::to_string(step),
                        to + "/checkpoint/step-" + std::to_string(step),
                        std::filesystem::copy_options::recursive);
}

}  // namespace

TEST(Sharded, MatchesDdpAndOneRankWithTheSameGlobalBatch) {
  test::TempDir dir;
  const std::string off = "--checkpoint.enable false --diagnostics.verify_every 1";
  ASSERT_EQ(test::run_lockstep(train_args(dir / "one", 10, off + " --training.local_batch_size 8")).code, 0);
  CliRun ddp = test::run_on_ranks(2, train_args(dir / "ddp", 10, off + " --training.local_batch_size 4"),
                                  Launcher::kLockstepRun);
  ASSERT_EQ(ddp.code, 0) << ddp.out;
  CliRun sh2 = test::run_on_ranks(
      2, train_args(dir / "sh2", 10, off + " --training.local_batch_size 4 --parallelism.mode sharded"),
      Launcher::kLockstepRun);
  ASSERT_EQ(sh2.code, 0) << sh2.out;
  EXPECT_NE(sh2.out.find("sharded data parallel (this rank owns"), std::string::npos) << sh2.out;
  CliRun sh4 = test::run_on_ranks(
      4, train_args(dir / "sh4", 10, off + " --training.local_batch_size 2 --parallelism.mode sharded"),
      Launcher::kMpirunGloo);
  ASSERT_EQ(sh4.code, 0) << sh4.out;

  const auto one = test::outcome(dir / "one", 1);
  const auto d = test::outcome(dir / "ddp", 2), s2 = test::outcome(dir / "sh2", 2),
             s4 = test::outcome(dir / "sh4", 4);
  expect_same_run(d, one, "ddp 2 ranks");
  expect_same_run(s2, one, "sharded 2 ranks");
  expect_same_run(s4, one, "sharded 4 ranks");
  for (const auto* o : {&s2, &s4})
    for (const auto& crc : o->crcs) {
      EXPECT_EQ(crc.size(), 8u);
      EXPECT_EQ(crc, o->crcs[0]) << "sharded parameters differ between ranks";
    }
  // A two-rank sum is the same in either order, so reduce-scatter and all-reduce agree bitwise.
  EXPECT_EQ(s2.crcs[0], d.crcs[0]) << "sharded and ddp must give the same weights on 2 ranks";

  // Small buckets (many calls, blocks not back to back) give the very same weights, over MPI
  // (which stages them into one buffer) and Gloo.
  const std::string small = off + " --training.local_batch_size 4 --parallelism.mode sharded "
                                  "--parallelism.bucket_mb 0.01";
  CliRun mpi = test::run_on_ranks(2, train_args(dir / "mpi", 10, small), Launcher::kMpirunMpi);
  ASSERT_EQ(mpi.code, 0) << mpi.out;
  CliRun gloo = test::run_on_ranks(2, train_args(dir / "gloo", 10, small), Launcher::kLockstepRun);
  ASSERT_EQ(gloo.code, 0) << gloo.out;
  EXPECT_EQ(test::outcome(dir / "mpi", 2).crcs[0], s2.crcs[0]);
  EXPECT_EQ(test::outcome(dir / "gloo", 2).crcs[0], s2.crcs[0]);
}

TEST(Sharded, CheckpointsResumeAtAnyWorldSizeAndInEitherMode) {
  test::TempDir dir;
  const std::string ck = " --checkpoint.interval 6 --checkpoint.keep_latest_k 0";
  const std::string sharded2 = ck + " --training.local_batch_size 4 --parallelism.mode sharded";
  CliRun full = test::run_on_ranks(2, train_args(dir / "full", 12, sharded2), Launcher::kLockstepRun);
  ASSERT_EQ(full.code, 0) << full.out;
  const auto uninterrupted = test::outcome(dir / "full", 2);

  // One optimizer file per rank, their ranges tiling the flat parameter space.
  const json meta = json::parse(read_text(dir / "full/checkpoint/step-6/meta.json"));
  EXPECT_EQ(meta["mode"], "sharded");
  ASSERT_EQ(meta["optimizer_shards"].size(), 2u);
  EXPECT_EQ(meta["optimizer_shards"][0]["offset"], 0);
  EXPECT_EQ(meta["optimizer_shards"][1]["offset"], meta["optimizer_shards"][0]["length"]);
  for (const char* f : {"model.safetensors", "optimizer-rank0.safetensors", "optimizer-rank1.safetensors"})
    EXPECT_TRUE(std::filesystem::exists(dir / "full/checkpoint/step-6/" + f)) << f;
  EXPECT_FALSE(std::filesystem::exists(dir / "full/checkpoint/step-6/optimizer.safetensors"));

  struct Resume {
    const char* name;
    int world;
    const char* args;
    bool bitwise;  // two ranks: the very same sums as the uninterrupted run
  };
  for (const Resume& r : {Resume{"same", 2, "--training.local_batch_size 4 --parallelism.mode sharded", true},
                          Resume{"as_ddp", 2, "--training.local_batch_size 4 --parallelism.mode ddp", true},
                          Resume{"three", 3, "--training.local_batch_size 4 --parallelism.mode sharded", false},
                          Resume{"one", 1, "--training.local_batch_size 8 --parallelism.mode sharded", false},
                          Resume{"one_ddp", 1, "--training.local_batch_size 8", false}}) {
    SCOPED_TRACE(r.name);
    const std::string run = dir / r.name;
    seed_checkpoint(dir / "full", 6, run);
    // Three ranks of 4 make a global batch of 12, not 8: compare the counters, not the losses.
    const std::string args = train_args(run, 12, ck + " " + r.args);
    CliRun c = r.world == 1 ? test::run_lockstep(args) : test::run_on_ranks(r.world, args, Launcher::kLockstepRun);
    ASSERT_EQ(c.code, 0) << c.out;
    EXPECT_NE(c.out.find("resumed from"), std::string::npos) << c.out;
    const auto o = test::outcome(run, r.world);
    ASSERT_EQ(o.losses.size(), 6u);
    if (r.bitwise) {
      EXPECT_EQ(o.crcs[0], uninterrupted.crcs[0]);
      EXPECT_EQ(o.losses, std::vector<double>(uninterrupted.losses.begin() + 6, uninterrupted.losses.end()));
    } else if (r.world == 1) {
      expect_same_run(o, uninterrupted, r.name, 6);
    } else {
      EXPECT_NEAR(o.losses[0], uninterrupted.losses[6], 0.05) << "resumed from the step-6 weights";
    }
    const json m = json::parse(read_text(run + "/checkpoint/step-12/meta.json"));
    EXPECT_EQ(m["step"], 12);
    EXPECT_EQ(m["optimizer_steps"], 12);
    EXPECT_EQ(m["world_size"], r.world);
  }
}

TEST(Sharded, ADamagedOrMissingShardIsNamed) {
  test::TempDir dir;
  CliRun full = test::run_on_ranks(
      2, train_args(dir / "full", 4, "--checkpoint.interval 4 --training.local_batch_size 4 "
                                     "--parallelism.mode sharded"),
      Launcher::kLockstepRun);
  ASSERT_EQ(full.code, 0) << full.out;
  const std::string shard = dir / "full/checkpoint/step-4/optimizer-rank1.safetensors";
  const std::string good = read_text(shard);

  // One flipped byte near the end (the data, not the header).
  std::string bad = good;
  bad[bad.size() - 9] = static_cast<char>(bad[bad.size() - 9] ^ 0x40);
  test::write_bytes(shard, bad);
  const std::string resume = train_args(dir / "full", 8, "--training.local_batch_size 8 "
                                                          "--parallelism.mode sharded");
  CliRun r = test::run_lockstep(resume);
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("optimizer-rank1.safetensors"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("CRC32"), std::string::npos) << r.out;
  CliRun info = test::run_lockstep("checkpoint info " + dir / "full/checkpoint");
  EXPECT_NE(info.out.find("sharded"), std::string::npos) << info.out;

  std::filesystem::remove(shard);
  r = test::run_lockstep(resume);
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("optimizer-rank1.safetensors"), std::string::npos) << r.out;

  test::write_bytes(shard, good);
  EXPECT_EQ(test::run_lockstep(resume).code, 0) << "restored: the checkpoint loads again";
}

// ---- a full disk during a save ------------------------------------------------------------

namespace {

// A tmpfs of `bytes` mounted for the test's lifetime (skipped where mounting is not allowed).
class SmallDisk {
 public:
  SmallDisk(const std::string& path, int64_t bytes) : path_(path) {
    std::filesystem::create_directories(path);
    const std::string opts = "size=" + std::to_string(bytes);
    mounted_ = ::mount("tmpfs", path.c_str(), "tmpfs", 0, opts.c_str()) == 0;
  }
  ~SmallDisk() {
    if (mounted_) ::umount(path_.c_str());
  }
  bool mounted() const { return mounted_; }

 private:
  std::string path_;
  bool mounted_ = false;
};

int64_t folder_bytes(const std::string& path) {
  int64_t n = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(path))
    if (e.is_regular_file()) n += static_cast<int64_t>(e.file_size());
  return n;
}

}  // namespace

TEST(CheckpointSave, AFullDiskLeavesTheEarlierCheckpointAndSaysSo) {
  for (const bool sharded : {false, true}) {
    SCOPED_TRACE(sharded ? "sharded, 2 ranks" : "ddp, 2 ranks");
    test::TempDir dir;
    const std::string mode = sharded ? " --parallelism.mode sharded" : "";
    // How big is one checkpoint of this job? Then a disk that holds one and a half.
    CliRun probe = test::run_on_ranks(
        2, train_args(dir / "probe", 3, "--checkpoint.interval 3 --training.local_batch_size 4" + mode),
        Launcher::kLockstepRun);
    ASSERT_EQ(probe.code, 0) << probe.out;
    const int64_t one = folder_bytes(dir / "probe/checkpoint/step-3");
    SmallDisk disk(dir / "disk", one * 3 / 2);
    if (!disk.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN)";

    CliRun r = test::run_on_ranks(
        2, train_args(dir / "run", 9, "--checkpoint.interval 3 --training.local_batch_size 4 "
                                      "--checkpoint.folder " + dir / "disk" + mode),
        Launcher::kLockstepRun);
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("was not saved"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("No space left on device"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("the earlier checkpoints are intact (latest: " + dir / "disk/step-3)"),
              std::string::npos)
        << r.out;
    // Both ranks stopped on it (neither hangs in a collective), nothing half-written remains.
    for (int rank = 0; rank < 2; ++rank)
      EXPECT_NE(read_text(dir / "run/logs/rank" + std::to_string(rank) + ".log").find("was not saved"),
                std::string::npos)
          << "rank " << rank;
    std::vector<std::string> left;
    for (const auto& e : std::filesystem::directory_iterator(dir / "disk"))
      left.push_back(e.path().filename().string());
    EXPECT_EQ(left, std::vector<std::string>{"step-3"});
    CliRun info = test::run_lockstep("checkpoint info " + dir / "disk");
    EXPECT_EQ(info.code, 0) << info.out;
    EXPECT_EQ(info.out.find("MISMATCH"), std::string::npos) << info.out;
    EXPECT_EQ(info.out.find("crc32 ") != std::string::npos, true) << info.out;
  }
}
