// Every rank runs the same job, or none trains (issue 25, requirement 1): a rank started with
// another learning rate, seed, accumulation, model size, bucket size or skip setting, or with
// another data file, stops every rank at start with exit code 2 and a line naming each
// differing key and its value on each rank — under Gloo and MPI, ddp and sharded; before this,
// such runs trained divergent weights with exit 0, crashed in Gloo, corrupted MPI's heap, or
// timed out without naming the cause. Per-rank keys (threads, the rank's own path to the same
// data) may differ. A resume on data whose content changed is refused by name.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "fingerprint.h"
#include "test_util.h"

using namespace lockstep;
using test::Launcher;

namespace {

std::string small_job(const std::string& dir, const std::string& extra = "") {
  return "train --job.dump_folder " + dir +
         " --training.steps 4 --model.dim 32 --model.n_heads 2 --model.n_layers 1"
         " --model.max_seq_len 32 --training.seq_len 32 --training.local_batch_size 4"
         " --checkpoint.interval 2 --metrics.log_freq 1 " + extra;
}

// The command that runs `lockstep ARGS` on 2 ranks, rank 1 by the shell line `rank1` (which
// passes "$@" on: `exec lockstep "$@" --more`).
std::string with_rank1(const test::TempDir& dir, const std::string& args, Launcher launcher,
                       const std::string& rank1) {
  const std::string wrapper = dir / "rank1.sh";
  test::write_bytes(wrapper, "#!/bin/sh\nr=${RANK:-$OMPI_COMM_WORLD_RANK}\n"
                             "if [ \"$r\" = 1 ]; then " + rank1 + "; fi\nexec " LOCKSTEP_BIN
                             " \"$@\"\n");
  std::filesystem::permissions(wrapper, std::filesystem::perms::owner_all);
  std::string cmd = test::launch_command(2, args, launcher);
  const std::string program = std::string(" ") + LOCKSTEP_BIN + " ";  // not lockstep-run's path
  cmd.replace(cmd.rfind(program), program.size(), " " + wrapper + " ");
  return cmd;
}

// The same with `rank1_args` added to rank 1's command line.
std::string with_rank1_args(const test::TempDir& dir, const std::string& args, Launcher launcher,
                            const std::string& rank1_args) {
  return with_rank1(dir, args, launcher,
                    std::string("exec ") + LOCKSTEP_BIN + " \"$@\" " + rank1_args);
}

void write_text_file(const std::string& path, const std::string& phrase) {
  std::ofstream out(path);
  for (int i = 0; i < 4000; ++i) out << phrase;
}

}  // namespace

TEST(SameJob, DifferencesAreNamedPerKeyAndGroupedByValue) {
  std::vector<std::map<std::string, std::string>> ranks(5, {{"optimizer.lr", "0.003"},
                                                            {"training.seed", "42"}});
  ranks[1]["optimizer.lr"] = "0.001";
  ranks[4]["optimizer.lr"] = "0.001";
  ranks[3].erase("training.seed");
  EXPECT_EQ(job_differences(ranks),
            "optimizer.lr is 0.003 on ranks 0, 2-3 and 0.001 on ranks 1, 4; training.seed is 42 "
            "on ranks 0-2, 4 and (not set) on rank 3");
  EXPECT_EQ(job_differences({ranks[0], ranks[2]}), "");
}

// Each setting that used to diverge, crash, corrupt or time out: exit 2 on every rank, the key
// named with both values, no checkpoint written.
TEST(SameJob, ARankWithAnotherConfigStopsEveryRankNamingTheKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--optimizer.lr 0.001", "optimizer.lr is 0.003 on rank 0 and 0.001 on rank 1"},
      {"--training.seed 7", "training.seed is 42 on rank 0 and 7 on rank 1"},
      {"--training.gradient_accumulation_steps 2",
       "training.gradient_accumulation_steps is 1 on rank 0 and 2 on rank 1"},
      {"--model.n_layers 2", "model.n_layers is 1 on rank 0 and 2 on rank 1"},
      {"--parallelism.bucket_mb 1", "parallelism.bucket_mb is 16.0 on rank 0 and 1.0 on rank 1"},
      {"--skip.enabled true", "skip.enabled is false on rank 0 and true on rank 1"}};
  // The check is one exchange whatever the launcher and mode: each case runs once, the cases
  // taking turns over both backends (Gloo under lockstep-run, MPI under mpirun) and both modes.
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& [rank1, named] = cases[i];
    const Launcher launcher = i % 2 == 0 ? Launcher::kLockstepRun : Launcher::kMpirunMpi;
    const char* mode = (i / 2) % 2 == 0 ? "ddp" : "sharded";
    test::TempDir dir;
    SCOPED_TRACE(std::string(mode) + " " + rank1 +
                 (launcher == Launcher::kMpirunMpi ? " (MPI)" : " (Gloo)"));
    const auto run = test::capture(with_rank1_args(
        dir, small_job(dir / "run", std::string("--parallelism.mode ") + mode), launcher, rank1));
    EXPECT_EQ(run.code, 2) << run.out;
    EXPECT_NE(run.out.find("the ranks do not run the same job: " + named), std::string::npos)
        << run.out;
    EXPECT_FALSE(std::filesystem::exists(dir / "run/checkpoint")) << run.out;
  }
}

TEST(SameJob, ADataFileWithOtherContentIsNamedButTheRanksOwnPathsMayDiffer) {
  test::TempDir dir;
  std::filesystem::create_directories(dir / "a");
  std::filesystem::create_directories(dir / "b");
  write_text_file(dir / "a/text.txt", "the quick brown fox jumps over the lazy dog. ");
  write_text_file(dir / "b/renamed.txt", "the quick brown fox jumps over the lazy dog. ");
  std::filesystem::create_directories(dir / "c");
  write_text_file(dir / "c/text.txt", "a completely different text, of other words. ");
  const std::string job = small_job(dir / "run", "--data.source file --data.path " + dir / "a/text.txt");
  // The same file content under another path and name, and other threads: one job.
  const auto same = test::capture(with_rank1_args(
      dir, job, Launcher::kLockstepRun, "--data.path " + dir / "b/renamed.txt --training.threads 1"));
  EXPECT_EQ(same.code, 0) << same.out;
  const auto other = test::capture(with_rank1_args(dir, small_job(dir / "run2", "--data.source file --data.path " + dir / "a/text.txt"),
                                                   Launcher::kLockstepRun,
                                                   "--data.path " + dir / "c/text.txt"));
  EXPECT_EQ(other.code, 2) << other.out;
  EXPECT_NE(other.out.find("data.file.0 is 180000 tokens, bytes, crc32 "), std::string::npos)
      << other.out;
  // The fingerprint is in meta.json.
  const auto meta = nlohmann::json::parse(test::read_text(dir / "run/checkpoint/step-4/meta.json"));
  EXPECT_EQ(meta.at("fingerprint").at("digest").get<std::string>().size(), 8u);
  EXPECT_TRUE(meta.at("fingerprint").at("items").contains("optimizer.lr"));
  EXPECT_FALSE(meta.at("fingerprint").at("items").contains("training.threads"));
}

// The whole file is its content (issue 42: a file whose first 4,096 tokens matched trained on
// with exit 0), digested once and then found in the digest cache until the file is rewritten —
// a rewrite that keeps the size and puts the old modification time back included.
TEST(SameJob, AResumeOnDataWhoseContentChangedIsRefused) {
  test::TempDir dir;
  const std::string data = dir / "text.txt";
  write_text_file(data, "the quick brown fox jumps over the lazy dog. ");
  const std::string job = "LOCKSTEP_DIGEST_CACHE=" + dir / "cache" + " " + LOCKSTEP_BIN + " " +
                          small_job(dir / "run", "--data.source file --data.path " + data);
  const auto first = test::capture(job);
  ASSERT_EQ(first.code, 0) << first.out;
  EXPECT_NE(first.out.find("data: 1 file digested (0.2 MiB read"), std::string::npos)
      << first.out;
  const auto again = test::capture(job + " --training.steps 5");
  ASSERT_EQ(again.code, 0) << again.out;
  EXPECT_NE(again.out.find("data: 1 file digested (0.0 MiB read in"), std::string::npos) << again.out;
  EXPECT_NE(again.out.find("1 from the digest cache"), std::string::npos) << again.out;
  // One byte near the end changes: same path, size, first tokens and modification time.
  const auto when = std::filesystem::last_write_time(data);
  std::string text = test::read_text(data);
  text[text.size() - 10] = '!';
  test::write_bytes(data, text);
  std::filesystem::last_write_time(data, when);
  const auto refused = test::capture(job + " --training.steps 6");
  EXPECT_EQ(refused.code, 2) << refused.out;
  EXPECT_NE(refused.out.find("resume reads other data than the run trained on"),
            std::string::npos)
      << refused.out;
  EXPECT_NE(refused.out.find("data.file.0 is 180000 tokens, bytes, crc32 "), std::string::npos)
      << refused.out;
  const auto allowed =
      test::capture(job + " --training.steps 6 --checkpoint.allow_data_change true");
  EXPECT_EQ(allowed.code, 0) << allowed.out;
  EXPECT_NE(allowed.out.find("resume with checkpoint.allow_data_change: other data"),
            std::string::npos)
      << allowed.out;
}

// The digest cache binds each entry to what it says (issue 52): an entry edited to claim the
// file's old CRC (after the one byte changed) does not carry this user's key, so the file is
// read again and the resume is refused, not trained on changed data with exit 0.
TEST(SameJob, ADigestCacheEntryThatLiesIsCaughtAndTheFileReadAgain) {
  test::TempDir dir;
  const std::string data = dir / "text.txt";
  write_text_file(data, "the quick brown fox jumps over the lazy dog. ");
  const std::string cache = dir / "cache";
  const std::string job = "LOCKSTEP_DIGEST_CACHE=" + cache + " " + LOCKSTEP_BIN + " " +
                          small_job(dir / "run", "--data.source file --data.path " + data);
  ASSERT_EQ(test::capture(job).code, 0);
  const auto entry = [&] {
    for (const auto& f : std::filesystem::directory_iterator(cache))
      if (f.path().extension() == ".json") return f.path().string();
    return std::string();
  };
  ASSERT_FALSE(entry().empty());
  const std::string old_crc =
      nlohmann::json::parse(test::read_text(entry())).at("crc32").get<std::string>();
  const auto when = std::filesystem::last_write_time(data);
  std::string text = test::read_text(data);
  text[text.size() - 10] = '!';
  test::write_bytes(data, text);
  std::filesystem::last_write_time(data, when);
  ASSERT_EQ(test::capture(job + " --training.steps 6").code, 2);  // refused; the entry is new
  nlohmann::json lie = nlohmann::json::parse(test::read_text(entry()));
  ASSERT_NE(lie.at("crc32").get<std::string>(), old_crc);
  lie["crc32"] = old_crc;  // the new file's identity, the old file's CRC
  test::write_bytes(entry(), lie.dump());
  const auto resumed = test::capture(job + " --training.steps 6");
  EXPECT_EQ(resumed.code, 2) << resumed.out;
  EXPECT_NE(resumed.out.find("1 digest cache entry did not carry this user's key"),
            std::string::npos)
      << resumed.out;
  EXPECT_NE(resumed.out.find("resume reads other data than the run trained on"),
            std::string::npos)
      << resumed.out;
  // Read again, the entry is rewritten with the truth and trusted from then on.
  const auto refused = test::capture(job + " --training.steps 6");
  EXPECT_EQ(refused.code, 2) << refused.out;
  EXPECT_NE(refused.out.find("1 from the digest cache"), std::string::npos) << refused.out;
}

// What else changes results is in the fingerprint (issue 42): the validation file's content,
// the binary (its build id: another build of the same version), and in ddp the CPU's numerics
// (ATen's capability, which picks the optimizer's kernels: replicas diverged from step 2).
// Each stops every rank at start naming it; sharded, where one rank updates each part, accepts
// ranks that compute differently.
TEST(SameJob, AnotherValidationFileBinaryOrCpuCapabilityStopsEveryRank) {
  test::TempDir dir;
  write_text_file(dir / "valid.txt", "the quick brown fox jumps over the lazy dog. ");
  write_text_file(dir / "other.txt", "the quick brown cat jumps over the lazy dog. ");
  const std::string validating =
      "--validation.enable true --validation.freq 2 --validation.dataset_path " + dir / "valid.txt";
  const auto valid = test::capture(with_rank1_args(
      dir, small_job(dir / "v", validating), Launcher::kLockstepRun,
      "--validation.dataset_path " + dir / "other.txt"));
  EXPECT_EQ(valid.code, 2) << valid.out;
  EXPECT_NE(valid.out.find("validation.file.0 is 180000 tokens, bytes, crc32 "), std::string::npos)
      << valid.out;

  // Another build: the same binary with one byte of its build id changed.
  std::string binary = test::read_text(LOCKSTEP_BIN);
  const std::string version = test::run_lockstep("version").out;
  const std::string id = version.substr(version.find("build id ") + 9, 16);
  std::string raw;
  for (size_t i = 0; i + 1 < id.size(); i += 2)
    raw += static_cast<char>(std::stoi(id.substr(i, 2), nullptr, 16));
  const size_t at = binary.find(raw);
  ASSERT_NE(at, std::string::npos) << id;
  binary[at] = static_cast<char>(binary[at] ^ 1);
  test::write_bytes(dir / "lockstep-other", binary);
  std::filesystem::permissions(dir / "lockstep-other", std::filesystem::perms::owner_all);
  const auto build = test::capture(with_rank1(dir, small_job(dir / "b"), Launcher::kLockstepRun,
                                              "exec " + dir / "lockstep-other" + " \"$@\""));
  EXPECT_EQ(build.code, 2) << build.out;
  EXPECT_NE(build.out.find("lockstep.build is " + id.substr(0, 14)), std::string::npos)
      << build.out;

  const std::string default_cpu = std::string("ATEN_CPU_CAPABILITY=default exec ") + LOCKSTEP_BIN +
                                  " \"$@\"";
  const auto cpu = test::capture(with_rank1(dir, small_job(dir / "c"), Launcher::kLockstepRun,
                                            default_cpu));
  EXPECT_EQ(cpu.code, 2) << cpu.out;
  EXPECT_NE(cpu.out.find("machine.numerics is ATen CPU capability "), std::string::npos)
      << cpu.out;
  EXPECT_NE(cpu.out.find("and ATen CPU capability DEFAULT on rank 1"), std::string::npos)
      << cpu.out;
  EXPECT_NE(cpu.out.find("set ATEN_CPU_CAPABILITY to the same value"), std::string::npos)
      << cpu.out;
  const auto sharded =
      test::capture(with_rank1(dir, small_job(dir / "s", "--parallelism.mode sharded"),
                               Launcher::kLockstepRun, default_cpu));
  EXPECT_EQ(sharded.code, 0) << sharded.out;
}

// checkpoint.initial_load_path is read on every rank: ranks that see other weights there (a
// node-local copy; here a relative path from another working directory) stop at start instead
// of training from two models (issue 42, in fsdp).
TEST(SameJob, InitialWeightsThatDifferStopEveryRank) {
  test::TempDir dir;
  const std::string llama = " --model.name llama --checkpoint.interval 1 --training.steps 1";
  for (const char* seed : {"1", "2"}) {
    const std::string run = dir / (std::string("seed") + seed);
    ASSERT_EQ(test::run_lockstep(small_job(run, llama + " --training.seed " + seed)).code, 0);
    const std::string to = dir / (std::string("node") + seed);
    std::filesystem::create_directories(to);
    const auto exported = test::run_lockstep("export " + run + " " + to + "/weights");
    ASSERT_EQ(exported.code, 0) << exported.out;
  }
  const std::string job =
      small_job(dir / "run", llama + " --parallelism.mode fsdp --checkpoint.initial_load_path "
                             "weights");
  const std::string rank1 = "cd " + dir / "node2" + " && exec " + LOCKSTEP_BIN + " \"$@\"";
  const auto other =
      test::capture("cd " + dir / "node1" + " && " + with_rank1(dir, job, Launcher::kLockstepRun, rank1));
  EXPECT_EQ(other.code, 2) << other.out;
  EXPECT_NE(other.out.find("checkpoint.initial_load_path.model.safetensors is "),
            std::string::npos)
      << other.out;
  EXPECT_FALSE(std::filesystem::exists(dir / "run/checkpoint")) << other.out;
  std::filesystem::remove_all(dir / "node2/weights");
  std::filesystem::copy(dir / "node1/weights", dir / "node2/weights");
  const auto same =
      test::capture("cd " + dir / "node1" + " && " + with_rank1(dir, job, Launcher::kLockstepRun, rank1));
  EXPECT_EQ(same.code, 0) << same.out;
  EXPECT_NE(same.out.find("initial weights: "), std::string::npos) << same.out;
}

// The ranks agree on the checkpoint they resume from (issue 42): with rank 1 seeing a stale copy
// of the folder (a node-local disk or a lagging shared file system: here a bind mount in a mount
// namespace of its own), rank 0 resumed at step 20 and rank 1 at step 10, and the run wrote
// checkpoints that verify but hold two runs. Now every rank stops at start, naming rank 1 and
// the step, and nothing is written.
TEST(SameJob, RanksResumeFromTheSameCheckpointOrNoneStarts) {
  test::TempDir dir;
  if (test::capture("unshare -m sh -c 'mount --bind " + dir.path() + " " + dir.path() + "'").code != 0)
    GTEST_SKIP() << "no bind mount in a mount namespace here (unshare -m; it shows rank 1 a "
                    "folder of its own)";
  const std::string run = dir / "run", stale = dir / "stale";
  const std::string keep = " --checkpoint.interval 5 --checkpoint.keep_latest_k 0";
  auto job = [&](int steps) {
    return "train --job.dump_folder " + run + " --training.steps " + std::to_string(steps) +
           " --model.dim 32 --model.n_heads 2 --model.n_layers 1 --model.max_seq_len 32"
           " --training.seq_len 32 --training.local_batch_size 4 --metrics.log_freq 1" + keep;
  };
  ASSERT_EQ(test::run_on_ranks(2, job(10), Launcher::kLockstepRun).code, 0);
  std::filesystem::copy(run + "/checkpoint", stale, std::filesystem::copy_options::recursive);
  ASSERT_EQ(test::run_on_ranks(2, job(20), Launcher::kLockstepRun).code, 0);
  // Rank 1 sees the stale copy (steps 5 and 10) where the others see steps 5 to 20.
  const std::string wrapper = dir / "rank1.sh";
  test::write_bytes(wrapper, "#!/bin/sh\nif [ \"$RANK\" = 1 ]; then exec unshare -m sh -c 'mount "
                             "--bind " + stale + " " + run + "/checkpoint && exec " LOCKSTEP_BIN
                             " \"$@\"' sh \"$@\"; fi\nexec " LOCKSTEP_BIN " \"$@\"\n");
  std::filesystem::permissions(wrapper, std::filesystem::perms::owner_all);
  std::string cmd = test::launch_command(2, job(30), Launcher::kLockstepRun);
  const std::string program = std::string(" ") + LOCKSTEP_BIN + " ";
  cmd.replace(cmd.rfind(program), program.size(), " " + wrapper + " ");
  const auto r = test::capture(cmd);
  EXPECT_EQ(r.code, 3) << r.out;
  for (const char* rank : {"[rank 0] lockstep: error: ", "[rank 1] lockstep: error: "})
    EXPECT_NE(r.out.find(std::string(rank) + "checkpoint folder '" + run + "/checkpoint': rank 1 "
                         "(its newest: step 10) does not see '" + run + "/checkpoint/step-20' "
                         "that rank 0 resumes from"),
              std::string::npos)
        << r.out;
  EXPECT_FALSE(std::filesystem::exists(run + "/checkpoint/step-25")) << r.out;
  // With the folders the same again the run resumes at 20 and goes on.
  const auto again = test::run_on_ranks(2, job(25), Launcher::kLockstepRun);
  ASSERT_EQ(again.code, 0) << again.out;
  EXPECT_NE(again.out.find("resumed from"), std::string::npos) << again.out;
  EXPECT_TRUE(std::filesystem::exists(run + "/checkpoint/step-25")) << again.out;
}
