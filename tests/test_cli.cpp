// The lockstep binary as a user runs it: exit codes and one-line errors.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <thread>

#include <fstream>

#include <nlohmann/json.hpp>

#include "test_util.h"

using lockstep::test::capture;
using lockstep::test::CliRun;
using lockstep::test::outcome;
using lockstep::test::RunOutcome;
using lockstep::test::spawn_shell;

namespace {

// Runs `lockstep ARGS`, with `env` ("NAME=value ...") added to its environment.
CliRun run(const std::string& args, const std::string& env = "") {
  return capture((env.empty() ? "" : "env " + env + " ") + LOCKSTEP_BIN + " " + args);
}

int count_lines(const std::string& s) {
  return static_cast<int>(std::count(s.begin(), s.end(), '\n'));
}

}  // namespace

TEST(Cli, HelpAndVersion) {
  EXPECT_EQ(run("--help").code, 0);
  CliRun t = run("train --help");
  EXPECT_EQ(t.code, 0);
  EXPECT_NE(t.out.find("--section.key"), std::string::npos);
  EXPECT_EQ(run("config show --help").code, 0);
  EXPECT_EQ(run("checkpoint info --help").code, 0);
  CliRun v = run("version");
  EXPECT_EQ(v.code, 0);
  EXPECT_NE(v.out.find("LibTorch 2."), std::string::npos) << v.out;
  EXPECT_NE(v.out.find("MPI"), std::string::npos) << v.out;
}

TEST(Cli, MisspelledKeyExits2WithSuggestion) {
  CliRun r = run("train --training.stpes 5");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(count_lines(r.out), 1) << r.out;
  EXPECT_NE(r.out.find("'training.stpes'"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("did you mean 'training.steps'"), std::string::npos) << r.out;
}

TEST(Cli, ConfigCheckAndShow) {
  lockstep::test::TempDir dir;
  lockstep::test::write_bytes(dir / "bad.toml", "[optimizer]\nlr = -1\n");
  CliRun r = run("config check " + dir / "bad.toml");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("bad.toml:2"), std::string::npos) << r.out;
  lockstep::test::write_bytes(dir / "good.toml", "[training]\nsteps = 9\n");
  EXPECT_EQ(run("config check " + dir / "good.toml").code, 0);
  CliRun s = run("config show " + dir / "good.toml" + " --optimizer.lr 0.25");
  EXPECT_EQ(s.code, 0);
  EXPECT_NE(s.out.find("steps = 9"), std::string::npos) << s.out;
  EXPECT_NE(s.out.find("lr = 0.25"), std::string::npos) << s.out;
  EXPECT_NE(s.out.find("warmup_steps = 20"), std::string::npos) << s.out;  // a default
  // Without a file, an override's value is not taken for one.
  CliRun no_file = run("config show --optimizer.lr 0.25");
  EXPECT_EQ(no_file.code, 0) << no_file.out;
  EXPECT_NE(no_file.out.find("lr = 0.25"), std::string::npos) << no_file.out;
  EXPECT_EQ(run("config check").code, 2);
  // The fault plan, as the trainer will inject it.
  CliRun plan = run("config faults --ranks 3 --training.steps 12 --fault.inject 'nan_grad@5:2, "
                    "spike@9:0'");
  EXPECT_EQ(plan.code, 0) << plan.out;
  EXPECT_EQ(plan.out, "{\"step\": 5, \"rank\": 2, \"kind\": \"nan_grad\"}\n"
                      "{\"step\": 9, \"rank\": 0, \"kind\": \"spike\"}\n");
  EXPECT_EQ(run("config check " + dir / "missing.toml").code, 2);
  EXPECT_EQ(run("train --config " + dir / "missing.toml").code, 2);
  EXPECT_EQ(run("frobnicate").code, 2);
  EXPECT_EQ(run("train stray").code, 2);
}

TEST(Cli, MissingLauncherVariableIsNamed) {
  CliRun bad = run("train", "RANK=0");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.out.find("WORLD_SIZE is not set"), std::string::npos) << bad.out;
}


TEST(Cli, TwoRanksOverGlooMatchOneRankWithTheSameGlobalBatch) {
  lockstep::test::TempDir dir;
  const std::string common =
      " --training.steps 8 --metrics.log_freq 1 --checkpoint.enable false --training.threads 1"
      " --model.dim 32 --model.n_heads 2 --training.seq_len 32 --model.max_seq_len 32";
  CliRun one = run("train --job.dump_folder " + dir / "one" + " --training.local_batch_size 8" +
                   common);
  ASSERT_EQ(one.code, 0) << one.out;

  // Two processes with torchrun's environment contract.
  const int port = lockstep::test::free_port();
  const std::string env = "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                          std::to_string(port);
  const std::string args = " train --job.dump_folder " + dir / "two" +
                           " --training.local_batch_size 4" + common + " >/dev/null 2>&1";
  const std::string script = "env " + env + " RANK=0 LOCAL_RANK=0 " + LOCKSTEP_BIN + args +
                             " & a=$!; env " + env + " RANK=1 LOCAL_RANK=1 " + LOCKSTEP_BIN +
                             args + "; b=$?; wait $a; a=$?; exit $((a | b))";
  ASSERT_EQ(std::system(("sh -c '" + script + "'").c_str()), 0);

  RunOutcome a = outcome(dir / "one", 1), b = outcome(dir / "two", 2);
  ASSERT_EQ(a.losses.size(), 8u);
  ASSERT_EQ(b.losses.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_NEAR(b.losses[i], a.losses[i], 1e-4) << "step " << i + 1;
  ASSERT_EQ(b.crcs[0].size(), 8u);
  EXPECT_EQ(b.crcs[0], b.crcs[1]) << "ddp parameters must be bitwise identical on all ranks";
}

TEST(Cli, AKilledRankMakesTheOtherExitInsteadOfHanging) {
  lockstep::test::TempDir dir;
  const int port = lockstep::test::free_port();
  auto spawn = [&](int rank) {
    return spawn_shell("exec env RANK=" + std::to_string(rank) +
                       " WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
                       " " + LOCKSTEP_BIN + " train --job.dump_folder " + dir / "run" +
                       " --training.steps 100000 --training.threads 1"
                       " --checkpoint.enable false --comm.train_timeout_seconds 5"
                       " >/dev/null 2>&1");
  };
  pid_t r0 = spawn(0), r1 = spawn(1);
  // Let them train (the metrics file appears at the first logged step), then kill rank 1.
  while (!std::filesystem::exists(dir / "run/metrics.jsonl")) {
    ASSERT_EQ(::waitpid(r0, nullptr, WNOHANG), 0) << "rank 0 ended before training";
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::kill(r1, SIGKILL);
  ::waitpid(r1, nullptr, 0);
  const auto start = std::chrono::steady_clock::now();
  int status = 0;
  while (::waitpid(r0, &status, WNOHANG) == 0 &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(30))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (::waitpid(r0, &status, WNOHANG) == 0 && secs >= 30) {
    ::kill(r0, SIGKILL);
    ::waitpid(r0, &status, 0);
    FAIL() << "rank 0 still running 30 s after rank 1 died";
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << "status " << status;
  EXPECT_LT(secs, 30) << "within 6x train_timeout_seconds";
}

TEST(Cli, BadDataFileExits3) {
  lockstep::test::TempDir dir;
  lockstep::test::write_bytes(dir / "empty.bin", "");
  CliRun r = run("train --job.dump_folder " + dir / "run" + " --data.source file --data.path " +
              dir / "empty.bin");
  EXPECT_EQ(r.code, 3);
  EXPECT_NE(r.out.find("empty.bin' is empty"), std::string::npos) << r.out;
}

TEST(Cli, CheckpointInfo) {
  lockstep::test::TempDir dir;
  CliRun t = run("train --job.dump_folder " + dir / "run" +
              " --training.steps 4 --checkpoint.interval 2 --model.dim 32 --model.n_heads 2");
  ASSERT_EQ(t.code, 0) << t.out;
  CliRun i = run("checkpoint info " + dir / "run/checkpoint");
  EXPECT_EQ(i.code, 0) << i.out;
  EXPECT_NE(i.out.find("step 4"), std::string::npos) << i.out;
  EXPECT_NE(i.out.find("wte.weight"), std::string::npos) << i.out;
  EXPECT_NE(i.out.find("0 checksum mismatches"), std::string::npos) << i.out;
  CliRun j = run("checkpoint info --json " + dir / "run/checkpoint/step-2");
  EXPECT_EQ(j.code, 0);
  EXPECT_NE(j.out.find("\"step\": 2"), std::string::npos) << j.out;
  EXPECT_EQ(run("checkpoint info " + dir.path()).code, 3);
}

TEST(Cli, KillDuringTrainingLeavesALoadableCheckpoint) {
  // A checkpoint every step with a model large enough that saving takes a good part of
  // the step: SIGKILL at random moments lands inside saves too. After each kill the latest
  // checkpoint must verify and the run must resume from it.
  lockstep::test::TempDir dir;
  const std::string args = "train --job.dump_folder " + dir / "run" +
                           " --training.steps 40 --checkpoint.interval 1"
                           " --checkpoint.keep_latest_k 2 --model.dim 256 --model.n_layers 3"
                           " --training.local_batch_size 2 --training.seq_len 16";
  std::mt19937 rng(1234);
  int kills = 0;
  // The newest complete checkpoint step, or -1.
  auto latest = [&] {
    int64_t best = -1;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir / "run/checkpoint", ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("step-", 0) == 0 && name.find('.') == std::string::npos &&
          std::filesystem::exists(e.path() / "meta.json"))
        best = std::max<int64_t>(best, std::stoll(name.substr(5)));
    }
    return best;
  };
  for (int attempt = 0; attempt < 3; ++attempt) {
    const int64_t before = latest();
    pid_t pid =
        spawn_shell("exec " + std::string(LOCKSTEP_BIN) + " " + args + " >/dev/null 2>&1");
    // Kill once this process has saved at least one checkpoint of its own (so the kill lands
    // in steady training and saving, not in start-up), at a random moment after that.
    int status = 0;
    ASSERT_TRUE(lockstep::test::wait_for(pid, [&] { return latest() > before; }, &status))
        << "the run ended before saving a checkpoint";
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 700));
    if (::waitpid(pid, &status, WNOHANG) == 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ++kills;
    }
    CliRun info = run("checkpoint info " + dir / "run/checkpoint");
    ASSERT_EQ(info.code, 0) << "after kill " << attempt << ": " << info.out;
    EXPECT_NE(info.out.find("0 checksum mismatches"), std::string::npos) << info.out;
  }
  EXPECT_GT(kills, 0) << "the run finished before any kill: make it longer";
  CliRun finish = run(args);
  EXPECT_EQ(finish.code, 0) << finish.out;
  EXPECT_NE(finish.out.find("resumed from"), std::string::npos) << finish.out;
  EXPECT_NE(finish.out.find("step     40/40"), std::string::npos) << finish.out;
}

// A person watching a run with `tail -f logs/rank0.log` sees each progress line as it is
// printed, not when a warning or the end flushes the file (issue 25: after 150 steps the file
// held 2 lines). The run is SIGKILLed: nothing flushes at exit.
TEST(Cli, TheRankLogShowsEachProgressLineAtOnce) {
  lockstep::test::TempDir dir;
  const std::string run = dir / "run";
  const pid_t pid = spawn_shell("exec " + std::string(LOCKSTEP_BIN) + " train --job.dump_folder " +
                                run +
                                " --training.steps 100000 --metrics.log_freq 2 "
                                "--checkpoint.enable false >/dev/null 2>&1");
  const auto count = [](const std::string& path, const char* what) {
    const std::string text = lockstep::test::read_text(path);
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  // metrics.jsonl is written a record per progress line, flushed each time: once it holds three,
  // the log must show three progress lines too (a few hundred bytes: no buffer fills up). Waits
  // for that event or the run's end, however slow the machine (ctest's timeout bounds it).
  int status = 0;
  bool ended = false;
  while (!ended && count(run + "/metrics.jsonl", "\"clip_coef\"") < 3) {
    ended = ::waitpid(pid, &status, WNOHANG) == pid;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!ended) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
  ASSERT_GE(count(run + "/metrics.jsonl", "\"clip_coef\""), 3u) << "the run ended early";
  EXPECT_GE(count(run + "/logs/rank0.log", "info step "), 3u)
      << lockstep::test::read_text(run + "/logs/rank0.log");
}

// A warning every rank raises alike is printed once, by rank 0, and kept in every rank's log
// (issue 25): the fault-injection notice and the skip line used to appear once per rank on the
// console.
TEST(Cli, AWarningAllRanksShareIsPrintedOnce) {
  lockstep::test::TempDir dir;
  const std::string run = dir / "run";
  const auto r = lockstep::test::run_on_ranks(
      2,
      "train --job.dump_folder " + run +
          " --training.steps 4 --checkpoint.enable false --skip.enabled true --fault.inject "
          "nan_grad@3:1",
      lockstep::test::Launcher::kLockstepRun);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto times = [](const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(times(r.out, "fault injection is on"), 1u) << r.out;
  EXPECT_EQ(times(r.out, "step 3: SKIP (nonfinite_grad)"), 1u) << r.out;
  for (int rank : {0, 1}) {
    const std::string log = lockstep::test::read_text(run + "/logs/rank" + std::to_string(rank) +
                                                      ".log");
    EXPECT_EQ(times(log, "fault injection is on"), 1u) << log;
    EXPECT_EQ(times(log, "step 3: SKIP (nonfinite_grad)"), 1u) << log;
  }
}

// generate refuses a temperature that is not a finite number >= 0 with exit 2 before reading
// anything (issue 25: NaN exited 1, inf was accepted and printed noise).
TEST(Cli, GenerateRefusesATemperatureThatIsNotFinite) {
  for (const char* t : {"nan", "inf", "-1"}) {
    const CliRun r = capture(std::string(LOCKSTEP_BIN) + " generate /nonexistent --temperature " + t);
    EXPECT_EQ(r.code, 2) << t << ": " << r.out;
    EXPECT_NE(r.out.find("expected a finite number >= 0"), std::string::npos) << r.out;
  }
}

// data shard's synthetic corpus has data.synthetic_tokens' range (issue 25: 3e9 died with
// std::bad_alloc): exit 2 naming the option and the range, nothing written.
TEST(Cli, DataShardRefusesASyntheticCorpusOutOfRange) {
  lockstep::test::TempDir dir;
  const CliRun r = capture(std::string(LOCKSTEP_BIN) + " data shard " + dir / "out" +
                           " --synthetic-tokens 3e9");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--synthetic-tokens: Value 3e9 not in range 1024 to 2147483648"),
            std::string::npos)
      << r.out;
  EXPECT_FALSE(std::filesystem::exists(dir / "out"));
}

// `lockstep report` on bad input: one line and lockstep's exit codes, never a Python traceback
// (issue 25: --out a folder, or a damaged record, printed a traceback and exited 1).
TEST(Cli, ReportRefusesAFolderAndDamagedRecordsInOneLine) {
  lockstep::test::TempDir dir;
  lockstep::test::write_bytes(dir / "metrics.jsonl", "{\"step\": 1, \"loss\": 2.0}\n{\"loss\": 1.5}\n");
  std::filesystem::create_directories(dir / "folder");
  const CliRun folder = capture(std::string(LOCKSTEP_BIN) + " report " + dir.path() +
                                " --out " + dir / "folder");
  EXPECT_EQ(folder.code, 2) << folder.out;
  EXPECT_NE(folder.out.find("--out '" + dir / "folder" + "' is a folder"), std::string::npos)
      << folder.out;
  const CliRun damaged = capture(std::string(LOCKSTEP_BIN) + " report " + dir.path());
  EXPECT_EQ(damaged.code, 3) << damaged.out;
  EXPECT_NE(damaged.out.find("lacks a field or has one of the wrong type"), std::string::npos)
      << damaged.out;
  for (const CliRun* r : {&folder, &damaged})
    EXPECT_EQ(r->out.find("Traceback"), std::string::npos) << r->out;
}

// ---- lockstep-run: torchrun's worker contract --------------------------------------------

namespace {

CliRun launcher(const std::string& args) {
  return capture(std::string(LOCKSTEP_RUN_BIN) + " " + args);
}

}  // namespace

TEST(LockstepRun, TrainsTwoRanksWithRankPrefixedOutput) {
  lockstep::test::TempDir dir;
  const int port = lockstep::test::free_port();
  CliRun r = launcher("--nproc-per-node 2 --master-port " + std::to_string(port) + " -- " +
                      LOCKSTEP_BIN + " train --job.dump_folder " + dir / "run" +
                      " --training.steps 6 --training.threads 1 --checkpoint.enable false"
                      " --model.dim 32 --model.n_heads 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("[rank 0] "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step      6/6"), std::string::npos) << r.out;
  RunOutcome o = outcome(dir / "run", 2);
  EXPECT_EQ(o.crcs[0].size(), 8u);
  EXPECT_EQ(o.crcs[0], o.crcs[1]);
}

// torchrun's habits: the worker command without `--`, --standalone (a free port on loopback),
// --no-python, and torchtitan's --job.config_file; an unknown option is refused, not run.
TEST(LockstepRun, TakesTorchrunsFormAndTorchtitansConfigFlag) {
  lockstep::test::TempDir dir;
  lockstep::test::write_bytes(dir / "job.toml", "[training]\nsteps = 4\nbatch_size = 4\n"
                                                "[checkpoint]\nenable_checkpoint = false\n");
  CliRun r = launcher("--standalone --no-python --nproc_per_node 2 " + std::string(LOCKSTEP_BIN) +
                      " train --job.config_file " + dir / "job.toml" + " --job.dump_folder " +
                      dir / "run" + " --model.dim 32 --model.n_heads 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step      4/4"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("global batch 4 x 1 x 2 ranks"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("read as lockstep's 'training.local_batch_size'"), std::string::npos) << r.out;
  EXPECT_FALSE(std::filesystem::exists(dir / "run/checkpoint"));
  r = launcher("--nproc-per-node 2 --bogus " + std::string(LOCKSTEP_BIN));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--bogus: is not an option of lockstep-run"), std::string::npos) << r.out;
  r = launcher("--nproc-per-node 2");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("no worker command given"), std::string::npos) << r.out;
}

TEST(LockstepRun, AFailedWorkerStopsTheOthersAndIsReported) {
  const auto start = std::chrono::steady_clock::now();
  CliRun r = launcher(
      "--nproc-per-node 3 --grace-seconds 2 -- sh -c 'if [ \"$RANK\" = 1 ]; then sleep 0.2; "
      "exit 3; fi; sleep 60'");
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("worker rank 1 (local rank 1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("failed first: exit code 3"), std::string::npos) << r.out;
  EXPECT_LT(secs, 10.0);
}

// A worker that does not stop within the grace is killed, and the launcher says so, naming it
// (it was SIGKILLed without a word; issue 42).
TEST(LockstepRun, AWorkerKilledAfterTheGraceIsReported) {
  lockstep::test::TempDir dir;
  const std::string ready = dir / "ignoring";  // rank 0 ignores SIGTERM from here on
  CliRun r = launcher("--nproc-per-node 2 --grace-seconds 0.5 -- sh -c 'if [ \"$RANK\" = 1 ]; "
                      "then while [ ! -e " + ready + " ]; do sleep 0.01; done; exit 3; fi; "
                      "trap \"\" TERM; touch " + ready + "; sleep 60'");
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("lockstep-run: worker rank 0 (local rank 0, pid "), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("did not stop within --grace-seconds 0.5 after signal 15: killed "
                       "(SIGKILL)"),
            std::string::npos)
      << r.out;
}

TEST(LockstepRun, RestartsAfterAFailure) {
  CliRun r = launcher(
      "--nproc-per-node 2 --max-restarts 1 -- sh -c 'if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] "
      "&& [ \"$RANK\" = 1 ]; then exit 5; fi; echo \"hello $RANK attempt "
      "$TORCHELASTIC_RESTART_COUNT of $WORLD_SIZE\"'");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("restarting all workers (restart 1 of 1)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 1] hello 1 attempt 1 of 2"), std::string::npos) << r.out;
  CliRun no = launcher("--nproc-per-node 1 -- sh -c 'exit 7'");
  EXPECT_EQ(no.code, 7) << no.out;
  EXPECT_EQ(launcher("--nproc-per-node 0 -- true").code, 2);
  EXPECT_EQ(launcher("--nproc-per-node 2").code, 2);  // no command
}

TEST(LockstepRun, ForwardsSigtermAndLeavesNoWorkerBehind) {
  lockstep::test::TempDir dir;
  const std::string marker = dir / "pids";
  const std::string cmd = "exec " + std::string(LOCKSTEP_RUN_BIN) +
                          " --nproc-per-node 2 --grace-seconds 2 -- sh -c 'echo $$ >> " + marker +
                          "; sleep 60' >/dev/null 2>&1";
  pid_t pid = spawn_shell(cmd);
  for (int i = 0; i < 500; ++i) {  // both workers started
    std::ifstream in(marker);
    std::string a, b;
    if (in >> a >> b) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM) << status;
  std::ifstream in(marker);
  int worker;
  int alive = 0;
  while (in >> worker) alive += ::kill(worker, 0) == 0 ? 1 : 0;
  EXPECT_EQ(alive, 0);
}

TEST(LockstepRun, BenchCommChecksEveryCollective) {
  const int port = lockstep::test::free_port();
  CliRun r = launcher("--nproc-per-node 2 --master-port " + std::to_string(port) + " -- " +
                      LOCKSTEP_BIN + " bench comm --sizes 4096 65536 --iters 3");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("2 ranks"), std::string::npos) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n') >= 8, true) << r.out;
  EXPECT_EQ(r.out.find("WRONG"), std::string::npos) << r.out;
  for (const char* op : {"all_reduce", "reduce_scatter", "all_gather", "broadcast"})
    EXPECT_NE(r.out.find(std::string("[rank 0] ") + op), std::string::npos) << op;
  EXPECT_EQ(run("bench comm").code, 2);  // one rank: nothing to measure
}

TEST(Bench, DecisionTimesBothFormsPerWorldSizeAndComparesThem) {
  CliRun r = run("bench decision --worlds 1 3 16 --steps 200");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("lockstep bench decision | "), std::string::npos) << r.out;
  for (const char* row : {"\n      1 | ", "\n      3 | ", "\n     16 | "})
    EXPECT_NE(r.out.find(row), std::string::npos) << row << "\n" << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 6) << r.out;
  // The bytes each rank receives: the other ranks' 72-byte rows (15 x 72 at 16 ranks).
  EXPECT_NE(r.out.find(" 1.1 KiB |"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("| NO"), std::string::npos) << r.out;
  EXPECT_EQ(run("bench decision --worlds 0").code, 2);  // a one-line usage error
}
