// A run folder belongs to one run (issue 16): the lock, fresh starts over an earlier run,
// nothing written by a rejected start, resumes that would change the data order.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "lockstep/config.h"
#include "rundir.h"
#include "test_util.h"

using namespace lockstep;
using json = nlohmann::json;
using test::CliRun;

namespace {

std::string job(const std::string& dir, int steps, const std::string& extra = "") {
  return "train --job.dump_folder " + dir + " --training.steps " + std::to_string(steps) +
         " --model.dim 32 --model.n_heads 2 --model.n_layers 1 --model.max_seq_len 32"
         " --training.seq_len 32 --training.local_batch_size 4 --training.threads 1"
         " --metrics.log_freq 1 " + extra;
}

}  // namespace

// Two runs on one folder: the second is refused at once, naming the first; the first finishes
// undisturbed and its checkpoints are its own.
TEST(RunFolder, ASecondRunIsRefusedWhileTheFirstHoldsIt) {
  test::TempDir dir;
  const std::string run = dir / "run";
  const pid_t first =
      test::spawn_shell(std::string(LOCKSTEP_BIN) + " " + job(run, 400, "--training.seed 1") +
                        " >" + dir / "first.out" + " 2>&1");
  for (int i = 0; i < 500 && !std::filesystem::exists(run + "/metrics.jsonl"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const CliRun second = test::run_lockstep(job(run, 400, "--training.seed 2"));
  int status = 0;
  ::waitpid(first, &status, 0);
  EXPECT_EQ(second.code, 2) << second.out;
  EXPECT_NE(second.out.find("is in use by another run (host "), std::string::npos) << second.out;
  EXPECT_NE(second.out.find(" pid "), std::string::npos) << second.out;
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << test::read_text(dir / "first.out");
  const json meta = json::parse(test::read_text(run + "/checkpoint/step-400/meta.json"));
  EXPECT_EQ(meta["config"]["training"]["seed"], 1);
  EXPECT_FALSE(std::filesystem::exists(run + "/.lock")) << "released at the end";
  const std::string log = test::read_text(run + "/logs/rank0.log");
  EXPECT_EQ(log.find("seed 2"), std::string::npos);
  // A lock left by a run that died (no process holds it any more) is taken over, with a warning.
  test::write_bytes(run + "/.lock", "host elsewhere pid 4194303 since 2026-01-01T00:00:00Z\n");
  const CliRun third = test::run_lockstep(job(run, 401, "--training.seed 1"));
  EXPECT_EQ(third.code, 0) << third.out;
  EXPECT_NE(third.out.find("took over the lock of a run that ended without releasing it (host "
                           "elsewhere pid 4194303"),
            std::string::npos)
      << third.out;
}

// A start that is rejected (another model, a fault on a rank that does not exist, no data)
// writes nothing into the folder: no config.toml over the run's, no logs; a fresh folder stays without logs/ and config.toml.
TEST(RunFolder, ARejectedStartWritesNothing) {
  test::TempDir dir;
  const std::string run = dir / "run";
  ASSERT_EQ(test::run_lockstep(job(run, 4)).code, 0);
  const std::string config_before = test::read_text(run + "/config.toml");
  const std::string log_before = test::read_text(run + "/logs/rank0.log");
  CliRun r = test::run_lockstep(job(run, 8, "--model.dim 64"));  // another model: exit 3
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_EQ(test::read_text(run + "/config.toml"), config_before);
  EXPECT_EQ(test::read_text(run + "/logs/rank0.log"), log_before);
  r = test::run_lockstep(job(run, 8, "--fault.inject nan_grad@6:3"));  // rank 3 of a 1-rank run
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("fault.inject"), std::string::npos) << r.out;
  EXPECT_EQ(test::read_text(run + "/config.toml"), config_before);
  EXPECT_EQ(test::read_text(run + "/logs/rank0.log"), log_before);
  const std::string fresh = dir / "fresh";
  test::write_bytes(dir / "empty.txt", "");
  r = test::run_lockstep(job(fresh, 4, "--data.source file --data.path " + dir / "empty.txt"));
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_FALSE(std::filesystem::exists(fresh + "/logs"));
  EXPECT_FALSE(std::filesystem::exists(fresh + "/config.toml"));
}

// Resuming with another seed, seq_len or data would point the data position at other samples:
// refused unless checkpoint.allow_data_change; another batch or world size warns.
TEST(RunFolder, AResumeThatChangesTheDataOrderIsRefused) {
  test::TempDir dir;
  const std::string run = dir / "run";
  ASSERT_EQ(test::run_lockstep(job(run, 4)).code, 0);
  CliRun r = test::run_lockstep(job(run, 8, "--training.seed 7"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("training.seed 42 -> 7"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("checkpoint.allow_data_change"), std::string::npos) << r.out;
  r = test::run_lockstep(job(run, 6, "--training.local_batch_size 2"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resume changes the global batch (4 -> 2 samples a step: "
                       "training.local_batch_size 4 -> 2)"),
            std::string::npos)
      << r.out;
  r = test::run_lockstep(job(run, 8, "--training.seed 7 --checkpoint.allow_data_change true"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resume with checkpoint.allow_data_change: training.seed 42 -> 7"),
            std::string::npos)
      << r.out;
}

// fs::remove_all (rm -rf, used for superseded checkpoints and temporary folders): a nested tree
// goes, a link inside it goes without what it points to, a missing path is no error.
TEST(RunFolder, RemoveAllTakesTheTreeAndLeavesLinkTargets) {
  test::TempDir dir;
  const std::string tree = dir / "tree", outside = dir / "outside";
  fs::make_dirs(tree + "/a/b");
  fs::make_dirs(outside);
  test::write_bytes(tree + "/a/b/file", "x");
  test::write_bytes(outside + "/kept", "y");
  std::filesystem::create_directory_symlink(outside, tree + "/a/link");
  fs::remove_all(tree);
  EXPECT_FALSE(fs::exists(tree));
  EXPECT_EQ(test::read_text(outside + "/kept"), "y");
  fs::remove_all(tree);  // already gone
  EXPECT_FALSE(fs::exists(tree));
}

// A resume that splits the same global batch otherwise (4 x 3 ranks -> 3 x 4) says so, not that
// the global batch changed (issue 25: it warned that it had).
TEST(RunFolder, AResumeThatSplitsTheSameGlobalBatchOtherwiseSaysSo) {
  Config before = default_config({{"training.local_batch_size", "4"}});
  const Config after = default_config({{"training.local_batch_size", "3"}});
  const auto w = check_resume(nlohmann::json::parse(to_json(before)), 3, after, 4);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_NE(w[0].find("resume splits the same global batch (12 samples a step) differently "
                      "(training.local_batch_size 4 -> 3, world size 3 -> 4)"),
            std::string::npos)
      << w[0];
}

// A fresh run over an earlier run's metrics.jsonl (no checkpoints to archive it with) writes a
// "start" record first, and `lockstep report` draws only the records after it (issue 25: the
// steps 1..N of both runs were appended with no marker).
TEST(RunFolder, AFreshRunOverAnEarlierMetricsFileMarksItsStart) {
  test::TempDir dir;
  const std::string run = dir / "run";
  ASSERT_EQ(test::run_lockstep(job(run, 3, "--checkpoint.enable false")).code, 0);
  const CliRun r = test::run_lockstep(job(run, 2, "--checkpoint.enable false"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("holds an earlier run's records; this run's follow a \"start\" record"),
            std::string::npos)
      << r.out;
  std::vector<std::string> kinds;
  std::istringstream in(test::read_text(run + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    kinds.push_back(j.contains("event") ? j["event"].get<std::string>()
                                        : std::to_string(j["step"].get<int64_t>()));
  }
  EXPECT_EQ(kinds, (std::vector<std::string>{"1", "2", "3", "start", "1", "2"}));
}
