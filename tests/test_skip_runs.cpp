// Skipping in real training runs: the semantics of a skip byte for byte, guards, resume in the
// middle of a detector window, agreement of 3 and 4 ranks under random faults, diag and report.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <set>

#include <nlohmann/json.hpp>

#include "fault.h"
#include "lockstep/config.h"
#include "lockstep/data.h"
#include "lockstep/error.h"
#include "lockstep/train.h"
#include "run_util.h"

using namespace lockstep;
using json = nlohmann::json;
using test::decisions;
using test::job;
using test::meta;
using test::read_jsonl;
using test::read_text;
using test::run_ranks;

TEST(SkipRun, ASkipLeavesWeightsAndOptimizerStateBitwiseUntouched) {
  for (const std::string on_skip : {"advance", "hold"}) {
    SCOPED_TRACE(on_skip);
    test::TempDir dir;
    TrainResult r = train(job(dir.path(), 9,
                              {{"checkpoint.interval", "1"},
                               {"fault.inject", "nan_grad@6:0"},
                               {"lr_scheduler.on_skip", on_skip}}));
    EXPECT_EQ(r.skipped_steps, 1);
    EXPECT_EQ(r.optimizer_steps, 8);
    const std::string before = dir / "checkpoint/step-5", after = dir / "checkpoint/step-6";
    // Parameters, moments and Adam step counts: the same bytes.
    EXPECT_EQ(read_text(before + "/model.safetensors"), read_text(after + "/model.safetensors"));
    EXPECT_EQ(read_text(before + "/optimizer.safetensors"),
              read_text(after + "/optimizer.safetensors"));
    const json m5 = meta(before), m6 = meta(after);
    EXPECT_EQ(m6["step"], 6);
    EXPECT_EQ(m6["optimizer_steps"], 5);
    EXPECT_EQ(m6["skipped_steps"], 1);
    EXPECT_EQ(m6["detector"]["consecutive_skips"], 1);
    EXPECT_EQ(m6["detector"]["grad_norms"], m5["detector"]["grad_norms"]) << "outlier kept out";
    EXPECT_EQ(m6["data_position"].get<int64_t>(), m5["data_position"].get<int64_t>() + 4)
        << "the data moves on past the skipped batch";
    // The next steps update again: the skipped gradient was zeroed, not carried over.
    const json m7 = meta(dir / "checkpoint/step-7");
    EXPECT_EQ(m7["optimizer_steps"], 6);
    EXPECT_EQ(m7["detector"]["consecutive_skips"], 0);
    EXPECT_NE(read_text(dir / "checkpoint/step-7/model.safetensors"),
              read_text(after + "/model.safetensors"));
    // LR: advance moves on with the step count; hold repeats the skipped step's lr.
    auto metrics = read_jsonl(dir / "metrics.jsonl");
    ASSERT_EQ(metrics.size(), 9u);
    EXPECT_EQ(metrics[5]["decision"], "skip");
    EXPECT_EQ(metrics[5]["skipped_steps"], 1);
    EXPECT_EQ(metrics[5]["consecutive_skips"], 1);
    EXPECT_EQ(metrics[6]["consecutive_skips"], 0);
    if (on_skip == "hold")
      EXPECT_EQ(metrics[6]["lr"], metrics[5]["lr"]);
    else
      EXPECT_NE(metrics[6]["lr"], metrics[5]["lr"]);
    // The event names the fault's rank, the parameters and the batch.
    auto events = read_jsonl(dir / "diagnostics/rank0.jsonl");
    ASSERT_EQ(events.size(), 1u);
    EXPECT_EQ(events[0]["step"], 6);
    EXPECT_EQ(events[0]["reasons"], json::array({"nonfinite_grad"}));
    // One rank alone cannot tell its batch from the model: no sample's loss names itself.
    EXPECT_EQ(events[0]["scope"], "global");
    EXPECT_EQ(events[0]["culprit_ranks"], json::array());
    EXPECT_EQ(events[0]["local"]["sample_ids"].size(), 4u);
    EXPECT_GT(events[0]["local"]["top_params"][0]["nonfinite"].get<int64_t>(), 0);
  }
}

TEST(SkipRun, NonfiniteWithSkippingOffAbortsWithCheckpointAndDiagnostics) {
  test::TempDir dir;
  try {
    train(job(dir.path(), 12,
              {{"skip.enabled", "false"}, {"fault.inject", "nan_loss@4:0"}}));
    FAIL() << "a NaN loss did not stop the run";
  } catch (const TrainingAborted& e) {
    const std::string msg = e.what();
    EXPECT_EQ(std::count(msg.begin(), msg.end(), '\n'), 0) << msg;
    EXPECT_NE(msg.find("step 4: aborted on nonfinite_grad, nonfinite_loss"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("culprit rank 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("checkpoint/step-3"), std::string::npos) << msg;
  }
  const json m = meta(dir / "checkpoint/step-3");
  EXPECT_EQ(m["optimizer_steps"], 3);
  auto events = read_jsonl(dir / "diagnostics/rank0.jsonl");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0]["decision"], "abort");
  // The culprit sample is the one whose own loss is NaN.
  ASSERT_EQ(events[0]["quarantine_sample_ids"].size(), 1u);
  EXPECT_EQ(events[0]["quarantine_sample_ids"][0], events[0]["local"]["sample_ids"][0]);
}

TEST(SkipRun, ConsecutiveGuardAbortsAndKeepsTheLastGoodState) {
  test::TempDir dir;
  try {
    train(job(dir.path(), 12,
              {{"skip.max_consecutive", "2"},
               {"checkpoint.interval", "100"},
               {"fault.inject", "inf_grad@5:0, nan_grad@6:0, nan_loss@7:0"}}));
    FAIL() << "the guard did not trip";
  } catch (const TrainingAborted& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("step 7: aborted"), std::string::npos) << msg;
    EXPECT_NE(msg.find("skip.max_consecutive = 2: 3 skips in a row"), std::string::npos) << msg;
    EXPECT_NE(msg.find("last good state saved"), std::string::npos) << msg;
  }
  const json m = meta(dir / "checkpoint/step-6");
  EXPECT_EQ(m["skipped_steps"], 2);
  EXPECT_EQ(m["optimizer_steps"], 4);
  auto events = read_jsonl(dir / "diagnostics/rank0.jsonl");
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[2]["decision"], "abort");
  // A resume from that checkpoint is protected from its first step: the same guard trips.
  EXPECT_THROW(train(job(dir.path(), 12,
                         {{"skip.max_consecutive", "2"},
                          {"fault.inject", "inf_grad@5:0, nan_grad@6:0, nan_loss@7:0"}})),
               TrainingAborted);
}

// ZClip's statistics travel in the checkpoint: a run resumed between its clips takes the same
// clips at the same bounds and ends with the same bytes.
TEST(SkipRun, AResumedZClipRunClipsAsTheUninterruptedOne) {
  test::TempDir dir;
  const std::vector<Override> policy = {{"skip.adaptive_clip", "zclip"},
                                        {"skip.zclip_warmup", "5"},
                                        {"checkpoint.interval", "10"},
                                        {"fault.inject", "spike@14:0, spike@24:0, spike@33:0"},
                                        {"fault.spike_factor", "4"}};
  train(job(dir / "full", 40, policy));
  std::filesystem::create_directories(dir / "resumed/checkpoint");
  std::filesystem::copy(dir / "full/checkpoint/step-20", dir / "resumed/checkpoint/step-20",
                        std::filesystem::copy_options::recursive);
  auto resumed = policy;
  resumed.push_back({"checkpoint.load_step", "20"});
  EXPECT_EQ(train(job(dir / "resumed", 40, resumed)).start_step, 20);
  const auto full = read_jsonl(dir / "full/diagnostics/rank0.jsonl");
  std::vector<std::string> after_20;
  for (const auto& e : full)
    if (e["step"].get<int64_t>() > 20) after_20.push_back(e.dump());
  std::vector<std::string> again;
  for (const auto& e : read_jsonl(dir / "resumed/diagnostics/rank0.jsonl"))
    again.push_back(e.dump());
  ASSERT_GE(after_20.size(), 2u) << "the spikes after the resume were clipped";
  EXPECT_EQ(again, after_20) << "the same events, bounds and counters, byte for byte";
  for (const auto& e : full) EXPECT_EQ(e["decision"], "clip") << e.dump();
  EXPECT_EQ(read_text(dir / "resumed/checkpoint/step-40/model.safetensors"),
            read_text(dir / "full/checkpoint/step-40/model.safetensors"));
  EXPECT_EQ(meta(dir / "resumed/checkpoint/step-40")["detector"]["zclip"],
            meta(dir / "full/checkpoint/step-40")["detector"]["zclip"]);
}

TEST(SkipRun, ResumeInTheMiddleOfTheWindowReproducesDecisionsAndWeights) {
  test::TempDir dir;
  const std::vector<Override> policy = {{"skip.window", "16"},
                                        {"skip.min_history", "6"},
                                        {"checkpoint.interval", "10"},
                                        {"fault.inject", "spike@13:0, nan_grad@17:0, spike@24:0"},
                                        {"fault.spike_factor", "50"}};
  auto with = [&](std::vector<Override> ov, std::vector<Override> more) {
    ov.insert(ov.end(), more.begin(), more.end());
    return ov;
  };
  train(job(dir / "full", 30, policy));
  // The second run starts from the first one's step-10 checkpoint: the window holds 10 values.
  std::filesystem::create_directories(dir / "resumed/checkpoint");
  std::filesystem::copy(dir / "full/checkpoint/step-10", dir / "resumed/checkpoint/step-10",
                        std::filesystem::copy_options::recursive);
  TrainResult r = train(job(dir / "resumed", 30, with(policy, {{"checkpoint.load_step", "10"}})));
  EXPECT_EQ(r.start_step, 10);
  EXPECT_EQ(decisions(dir / "resumed", 0), decisions(dir / "full", 0));
  EXPECT_EQ(decisions(dir / "full", 0).size(), 3u) << "two spikes and a NaN, nothing else";
  EXPECT_EQ(read_text(dir / "resumed/checkpoint/step-30/model.safetensors"),
            read_text(dir / "full/checkpoint/step-30/model.safetensors"));
  EXPECT_EQ(read_text(dir / "resumed/checkpoint/step-30/optimizer.safetensors"),
            read_text(dir / "full/checkpoint/step-30/optimizer.safetensors"));
  EXPECT_EQ(meta(dir / "resumed/checkpoint/step-30")["detector"],
            meta(dir / "full/checkpoint/step-30")["detector"]);
}

TEST(SkipRun, PoisonedSampleIsNamedAndAQuarantinedResumeNeverDrawsIt) {
  test::TempDir dir;
  // Find a sample drawn early: the first id of step 3 in a clean run.
  train(job(dir / "clean", 3, {{"checkpoint.enable", "false"}, {"skip.max_grad_norm", "1e-9"}}));
  auto ev = read_jsonl(dir / "clean/diagnostics/rank0.jsonl");
  ASSERT_EQ(ev.size(), 3u);  // every step skipped by the tiny threshold: all batches recorded
  const int64_t poison = ev[2]["local"]["sample_ids"][1];
  train(job(dir / "run", 6,
            {{"checkpoint.enable", "false"}, {"fault.poison_ids", std::to_string(poison)}}));
  auto events = read_jsonl(dir / "run/diagnostics/rank0.jsonl");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0]["step"], 3);
  EXPECT_EQ(events[0]["reasons"], json::array({"nonfinite_grad", "nonfinite_loss"}));
  EXPECT_EQ(events[0]["quarantine_sample_ids"], json::array({poison}));
  EXPECT_EQ(events[0]["suspect_sample_ids"], json::array());
  test::write_bytes(dir / "q.txt", "# quarantine\n" + std::to_string(poison) + "\n");
  TrainResult r = train(job(dir / "excluded", 6,
                            {{"checkpoint.enable", "false"},
                             {"fault.poison_ids", std::to_string(poison)},
                             {"data.exclude_ids_file", dir / "q.txt"}}));
  EXPECT_EQ(r.skipped_steps, 0);
}

// A quarantine stays in force: the checkpoint carries the exclude list, a resume without
// data.exclude_ids_file keeps excluding the ids, and only data.readmit_ids_file lets them go.
TEST(SkipRun, TheExcludeListTravelsInTheCheckpointUntilReadmitted) {
  test::TempDir dir;
  // 32 samples of 32 tokens, 4 a step: 8 steps an epoch; sample 5's loss is NaN when drawn.
  const std::vector<Override> small = {{"data.synthetic_tokens", "1025"},
                                             {"checkpoint.interval", "4"},
                                             {"fault.poison_ids", "5"}};
  auto with = [&](std::vector<Override> more) {
    more.insert(more.begin(), small.begin(), small.end());
    return more;
  };
  test::write_bytes(dir / "q.txt", "5\n");
  TrainResult r = train(job(dir.path(), 8, with({{"data.exclude_ids_file", dir / "q.txt"}})));
  EXPECT_EQ(r.skipped_steps, 0);
  EXPECT_EQ(meta(dir / "checkpoint/step-8")["excluded_ids"], json::array({5}));
  // Resumed without the file: two more epochs, sample 5 never drawn.
  r = train(job(dir.path(), 24, with({})));
  EXPECT_EQ(r.skipped_steps, 0) << "a resume without data.exclude_ids_file drew the quarantine";
  EXPECT_EQ(meta(dir / "checkpoint/step-24")["excluded_ids"], json::array({5}));
  // Readmitted: within 12 steps (48 draws, more than an epoch) the poisoned sample is back.
  r = train(job(dir.path(), 36, with({{"data.readmit_ids_file", dir / "q.txt"}})));
  EXPECT_GE(r.skipped_steps, 1) << "sample 5 was readmitted but never drawn";
  EXPECT_EQ(meta(dir / "checkpoint/step-36")["excluded_ids"], json::array());
  // A readmit file that cannot be read is named by its key.
  try {
    train(job(dir.path(), 40, with({{"data.readmit_ids_file", dir / "none.txt"}})));
    ADD_FAILURE() << "a missing data.readmit_ids_file was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("data.readmit_ids_file"), std::string::npos) << e.what();
  }
}

// ---- several ranks ------------------------------------------------------------------------

namespace {

using test::Launcher;
// Random faults on random ranks: every rank decides the same at every step, the skips are
// exactly the faulty steps, and the weights end bitwise equal on all ranks.
void expect_agreement(int world, int steps, uint64_t seed,
                      Launcher launcher = Launcher::kLockstepRun, const std::string& extra = "") {
  test::TempDir dir;
  const double p = 0.04;
  const std::string kinds = "nan_grad, inf_grad, nan_loss";
  auto r = run_ranks(world, dir.path(), steps,
                     "--skip.grad_norm_zscore 0 --skip.loss_zscore 0 --skip.max_consecutive 0 "
                     "--skip.max_fraction 0 --fault.random_p " + std::to_string(p) +
                         " --fault.random_seed " + std::to_string(seed) +
                         " --fault.random_kinds '" + kinds + "' " + extra,
                     launcher);
  ASSERT_EQ(r.code, 0) << r.out;

  FaultConfig f;
  f.random_p = p;
  f.random_seed = static_cast<int64_t>(seed);
  f.random_kinds = kinds;
  FaultPlan plan(f, world);
  std::vector<int64_t> expected_steps;
  std::vector<std::set<int>> expected_culprits;
  for (int s = 1; s <= steps; ++s) {
    std::set<int> c;
    bool sample_evidence = false;  // nan_loss: a sample's own loss is NaN
    for (int rank = 0; rank < world; ++rank)
      if (FaultKind k = plan.at(s, rank); k != FaultKind::kNone) {
        c.insert(rank);
        sample_evidence = sample_evidence || k == FaultKind::kNanLoss;
      }
    if (c.empty()) continue;
    expected_steps.push_back(s);
    // Local (culprits named): a minority of ranks, or samples that name themselves; else global.
    const bool local = sample_evidence || 2 * c.size() <= static_cast<size_t>(world);
    expected_culprits.push_back(local ? c : std::set<int>{});
  }
  ASSERT_GE(expected_steps.size(), 3u) << "the seed gives too few faults to test anything";

  const auto rank0 = decisions(dir.path(), 0);
  for (int rank = 1; rank < world; ++rank)
    EXPECT_EQ(decisions(dir.path(), rank), rank0) << "rank " << rank << " decided differently";
  auto events = read_jsonl(dir / "diagnostics/rank0.jsonl");
  ASSERT_EQ(events.size(), expected_steps.size());
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i]["step"], expected_steps[i]);
    EXPECT_EQ(events[i]["decision"], "skip");
    const auto culprits = events[i]["culprit_ranks"].get<std::vector<int>>();
    EXPECT_EQ(std::set<int>(culprits.begin(), culprits.end()), expected_culprits[i])
        << "step " << expected_steps[i];
  }
  auto metrics = read_jsonl(dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), static_cast<size_t>(steps));
  EXPECT_EQ(metrics.back()["skipped_steps"], expected_steps.size());
  EXPECT_EQ(metrics.back()["optimizer_steps"], steps - static_cast<int>(expected_steps.size()));
  const auto crcs = test::outcome(dir.path(), world).crcs;
  for (int rank = 0; rank < world; ++rank) {
    EXPECT_EQ(crcs[rank].size(), 8u) << "rank " << rank;
    EXPECT_EQ(crcs[rank], crcs[0]) << "rank " << rank << " holds other weights";
  }
}

}  // namespace

TEST(SkipAgreement, FourRanksRandomFaultsOnRandomRanks) { expect_agreement(4, 200, 3); }

TEST(SkipAgreement, ThreeRanksOddWorldSize) { expect_agreement(3, 120, 5); }

#if LOCKSTEP_WITH_MPI
constexpr bool kMpi = true;
#else
constexpr bool kMpi = false;
#endif

TEST(SkipAgreement, FourRanksOverMpiUnderMpirun) {
  if (!kMpi) GTEST_SKIP() << "built without MPI (LOCKSTEP_MPI=OFF)";
  expect_agreement(4, 120, 9, Launcher::kMpirunMpi);
}

TEST(SkipAgreement, FourShardedRanksOverMpiUnderMpirun) {
  if (!kMpi) GTEST_SKIP() << "built without MPI (LOCKSTEP_MPI=OFF)";
  expect_agreement(4, 120, 7, Launcher::kMpirunMpi, "--parallelism.mode sharded");
}

TEST(SkipAgreement, TwoRanksOverGlooUnderMpirun) {
  expect_agreement(2, 100, 12, Launcher::kMpirunGloo);
}

TEST(SkipAgreement, TwoRanksUnderRealTorchrun) {
  if (std::string(TORCHRUN).empty()) GTEST_SKIP() << "no torchrun found at configure time";
  expect_agreement(2, 100, 4, Launcher::kTorchrun);
}

// The same job over MPI and over Gloo: the same losses and the same weights, bit for bit (a
// two-rank sum is the same in either order).
TEST(SkipAgreement, MpiAndGlooGiveTheSameWeights) {
  if (!kMpi) GTEST_SKIP() << "built without MPI (LOCKSTEP_MPI=OFF)";
  test::TempDir dir;
  const std::string extra = "--fault.inject nan_grad@7:1 --skip.enabled true";
  auto a = run_ranks(2, dir / "gloo", 20, extra);
  ASSERT_EQ(a.code, 0) << a.out;
  auto b = run_ranks(2, dir / "mpi", 20, extra, Launcher::kMpirunMpi);
  ASSERT_EQ(b.code, 0) << b.out;
  const auto ga = test::outcome(dir / "gloo", 2), mb = test::outcome(dir / "mpi", 2);
  EXPECT_EQ(ga.crcs[0], mb.crcs[0]);
  EXPECT_EQ(mb.crcs[0], mb.crcs[1]);
  ASSERT_EQ(ga.losses.size(), mb.losses.size());
  for (size_t i = 0; i < ga.losses.size(); ++i)
    if (std::isfinite(ga.losses[i])) {
      EXPECT_EQ(ga.losses[i], mb.losses[i]) << "step " << i + 1;
    }
  EXPECT_NE(b.out.find("mpi collectives"), std::string::npos) << b.out;
}

// One parameter of rank 1 turns NaN after step 5's update (as a NaN in imported weights would):
// every sample of rank 1's next batch is NaN. The run used to skip into the guard, blaming both
// ranks and quarantining innocent samples; now the nonfinite step is checked against the
// parameters each rank holds, and every rank aborts at step 6 naming rank 1 and the tensor,
// quarantining nothing and saving nothing (issue 42).
TEST(SkipRun, ANonfiniteParameterAbortsBlamingTheModelNotTheSamples) {
  test::TempDir dir;
  auto r = run_ranks(2, dir.path(), 12,
                     "--fault.inject nan_weight@5:1 --skip.enabled true");
  EXPECT_EQ(r.code, 4) << r.out;
  EXPECT_NE(r.out.find("step 6: aborted on "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(nonfinite parameters on rank 1: wte.weight (1 nonfinite))"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("the model: its own parameters are nonfinite"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("nothing saved (the parameters are nonfinite)"), std::string::npos) << r.out;
  for (int rank = 0; rank < 2; ++rank) {
    const auto events = read_jsonl(dir / ("diagnostics/rank" + std::to_string(rank) + ".jsonl"));
    ASSERT_EQ(events.size(), 1u) << rank;
    EXPECT_EQ(events[0]["decision"], "abort");
    EXPECT_EQ(events[0]["cause"], "model");
    EXPECT_TRUE(events[0]["quarantine_sample_ids"].empty()) << events[0].dump();
    EXPECT_TRUE(events[0]["culprit_ranks"].empty()) << events[0].dump();
  }
}

TEST(SkipDiag, DiagNamesTheCulpritRankAndSamplesAndReportDrawsThePicture) {
  test::TempDir dir;
  // nan_grad belongs to the batch: rank 1's replay reproduces it, so the cause is data and,
  // with no sample's own loss standing out, the whole batch is suspect.
  auto r = run_ranks(2, dir.path(), 30,
                     "--fault.inject nan_grad@12:1 --metrics.log_freq 5 --skip.replay self");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step 12: SKIP (nonfinite_grad)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("culprit rank 1"), std::string::npos) << r.out;

  auto d = test::capture(std::string(LOCKSTEP_BIN) + " diag " + dir.path());
  ASSERT_EQ(d.code, 0) << d.out;
  EXPECT_NE(d.out.find("1 skipped, 0 aborted"), std::string::npos) << d.out;
  EXPECT_NE(d.out.find("culprit rank 1"), std::string::npos) << d.out;
  EXPECT_NE(d.out.find("injected fault: nan_grad"), std::string::npos) << d.out;
  EXPECT_NE(d.out.find("scope local, cause data"), std::string::npos) << d.out;
  EXPECT_NE(d.out.find("replay of rank 1's batch: its own replay reproduced"), std::string::npos)
      << d.out;
  EXPECT_NE(d.out.find("rank 1: culprit in 1 event(s) (nonfinite_grad 1)"), std::string::npos)
      << d.out;
  // Rank 1's batch of step 12 reproduced its NaN but no sample's own loss stands out: suspect,
  // named, not quarantined (a reproduction proves "not transient", not "bad sample").
  auto events = read_jsonl(dir / "diagnostics/rank1.jsonl");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0]["quarantine_sample_ids"], json::array());
  EXPECT_EQ(events[0]["suspect_sample_ids"], events[0]["local"]["sample_ids"]);
  EXPECT_NE(d.out.find("suspect samples, not quarantined"), std::string::npos) << d.out;
  EXPECT_FALSE(std::filesystem::exists(dir / "quarantine.txt")) << d.out;
  // Who wants them out anyway says so.
  d = test::capture(std::string(LOCKSTEP_BIN) + " diag --with-suspects " + dir.path());
  ASSERT_EQ(d.code, 0) << d.out;
  std::set<int64_t> quarantined;
  for (int64_t id : read_id_file(dir / "quarantine.txt")) quarantined.insert(id);
  EXPECT_EQ(quarantined.size(), 4u);
  for (const auto& id : events[0]["local"]["sample_ids"])
    EXPECT_EQ(quarantined.count(id.get<int64_t>()), 1u) << id;

  auto j = test::capture(std::string(LOCKSTEP_BIN) + " diag --json " + dir.path());
  ASSERT_EQ(j.code, 0) << j.out;
  EXPECT_EQ(json::parse(j.out)["events"][0]["culprit_ranks"], json::array({1}));
  EXPECT_EQ(test::capture(std::string(LOCKSTEP_BIN) + " diag " + dir / "nowhere").code, 3);

  auto rep = test::capture(std::string(LOCKSTEP_BIN) + " report " + dir.path());
  ASSERT_EQ(rep.code, 0) << rep.out;
  const std::string png = read_text(dir / "report.png");
  ASSERT_GT(png.size(), 10000u);
  EXPECT_EQ(png.substr(1, 3), "PNG");
}

// ---- reliability: restarts, signals, desync ----------------------------------------------

namespace {

// A rank killed mid-run (SIGKILL on the first attempt) under a launcher with --max-restarts:
// the restarted job resumes from the latest checkpoint and ends with the weights of a run that
// was never interrupted.
void expect_restart_resumes(Launcher launcher) {
  test::TempDir dir;
  const std::string ckpt = "--checkpoint.enable true --checkpoint.interval 5";
  auto clean = run_ranks(2, dir / "clean", 24, ckpt);
  ASSERT_EQ(clean.code, 0) << clean.out;
  auto r = run_ranks(2, dir / "crash", 24, ckpt + " --fault.inject crash@17:1", launcher,
                     "--max-restarts 1");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string log0 = read_text(dir / "crash/logs/rank0.log");
  EXPECT_NE(log0.find("resumed from " + dir / "crash/checkpoint/step-15"), std::string::npos)
      << log0;
  const auto a = test::outcome(dir / "clean", 2), b = test::outcome(dir / "crash", 2);
  EXPECT_EQ(b.crcs[0].size(), 8u);
  EXPECT_EQ(b.crcs[0], a.crcs[0]) << "the resumed run must end where the uninterrupted one does";
  EXPECT_EQ(b.crcs[1], a.crcs[0]);
}

}  // namespace

TEST(Reliability, LockstepRunRestartResumesFromTheLatestCheckpoint) {
  expect_restart_resumes(Launcher::kLockstepRun);
}

TEST(Reliability, TorchrunRestartResumesFromTheLatestCheckpoint) {
  if (std::string(TORCHRUN).empty()) GTEST_SKIP() << "no torchrun found at configure time";
  expect_restart_resumes(Launcher::kTorchrun);
}

TEST(Reliability, DesyncIsCaughtAndNamesTheDivergingRankOrSaysThereIsNoMajority) {
  test::TempDir dir;
  auto r = run_ranks(3, dir.path(), 20,
                     "--diagnostics.verify_every 5 --fault.inject desync@7:2");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step 10: desync: rank(s) 2 hold other parameters"), std::string::npos)
      << r.out;
  auto events = read_jsonl(dir / "diagnostics/rank0.jsonl");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0]["reasons"], json::array({"desync"}));
  EXPECT_EQ(events[0]["culprit_ranks"], json::array({2}));
  // Two ranks: no majority. Both disagree and neither is named, unless a replay blamed one.
  auto two = run_ranks(2, dir / "two", 20, "--diagnostics.verify_every 5 --fault.inject desync@7:1");
  EXPECT_NE(two.code, 0) << two.out;
  EXPECT_NE(two.out.find("step 10: desync: ranks 0, 1 disagree"), std::string::npos) << two.out;
  EXPECT_NE(two.out.find("no majority of 2 ranks says which diverged;"), std::string::npos)
      << two.out;
  EXPECT_EQ(read_jsonl(dir / "two/diagnostics/rank0.jsonl")[0]["culprit_ranks"], json::array());
  auto told = run_ranks(2, dir / "told", 20,
                        "--diagnostics.verify_every 5 --skip.replay self --skip.min_history 4 "
                        "--fault.inject 'transient_nan@6:1, desync@7:1'");
  EXPECT_NE(told.code, 0) << told.out;
  EXPECT_NE(told.out.find("rank 1 is the likely one: a replay or probe blamed its device at "
                          "step 6"),
            std::string::npos)
      << told.out;
  // Without the fault the same check passes at every 5th step.
  auto ok = run_ranks(3, dir / "ok", 20, "--diagnostics.verify_every 5");
  EXPECT_EQ(ok.code, 0) << ok.out;
}

TEST(Reliability, SigtermStopsEveryRankAfterACheckpoint) {
  test::TempDir dir;
  const int port = test::free_port();
  std::string args;
  for (const auto& [k, v] : test::tiny(dir.path(), 100000)) args += " --" + k + " '" + v + "'";
  const std::string cmd = "exec " + std::string(LOCKSTEP_RUN_BIN) +
                          " --nproc-per-node 2 --master-port " + std::to_string(port) + " -- " +
                          LOCKSTEP_BIN + " train" + args +
                          " --checkpoint.interval 100000 >" + dir / "out.txt" + " 2>&1";
  const pid_t pid = test::spawn_shell(cmd);
  // Let it train a little.
  test::wait_for(pid, [&] { return read_jsonl(dir / "metrics.jsonl").size() >= 20; });
  ASSERT_GE(read_jsonl(dir / "metrics.jsonl").size(), 20u) << read_text(dir / "out.txt");
  const auto start = std::chrono::steady_clock::now();
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(secs, 10.0);
  const std::string out = read_text(dir / "out.txt");
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 143) << out;
  for (const char* rank : {"[rank 0] lockstep: error: stopped by SIGTERM after step",
                           "[rank 1] lockstep: error: stopped by SIGTERM after step"})
    EXPECT_NE(out.find(rank), std::string::npos) << out;
  // Both ranks stopped after the same step, and that step is checkpointed.
  const auto metrics = read_jsonl(dir / "metrics.jsonl");
  const int64_t last = metrics.back()["step"];
  EXPECT_TRUE(std::filesystem::exists(dir / ("checkpoint/step-" + std::to_string(last))))
      << out;
  EXPECT_NE(out.find("checkpoint saved in " + dir / ("checkpoint/step-" + std::to_string(last))),
            std::string::npos)
      << out;
}

namespace {

// SIGTERM during a step of `micro_batches` micro-batches (issue 25: a stop waited for the whole
// step; with 65,536 it was ignored for 10 minutes): every rank ends its batch after the micro-batch in
// flight, the ranks agree on it in the step's exchange, nothing of the step lands, and the run
// stops at the step before with its checkpoint — in well under half a step (measured against
// the same run's steps). A resume then ends where an uninterrupted run ends, bit for bit.
void expect_stop_within_a_micro_batch(const std::string& extra, int micro_batches = 1000) {
  test::TempDir dir;
  std::string args;
  for (const auto& [k, v] : test::tiny(dir / "run", 100000)) args += " --" + k + " '" + v + "'";
  const std::string accumulation =
      " --training.gradient_accumulation_steps " + std::to_string(micro_batches);
  args += accumulation + " --checkpoint.interval 1"
          " --lr_scheduler.decay_type constant " + extra;
  const pid_t pid = test::spawn_shell(
      "exec " + std::string(LOCKSTEP_RUN_BIN) + " --nproc-per-node 2 --master-port " +
      std::to_string(test::free_port()) + " -- " + LOCKSTEP_BIN + " train" + args + " >" +
      dir / "out.txt" + " 2>&1");
  using Clock = std::chrono::steady_clock;
  const auto steps_logged = [&] { return read_jsonl(dir / "run/metrics.jsonl").size(); };
  ASSERT_TRUE(test::wait_for(pid, [&] { return steps_logged() >= 1; })) << read_text(dir / "out.txt");
  const auto first = Clock::now();
  ASSERT_TRUE(test::wait_for(pid, [&] { return steps_logged() >= 2; })) << read_text(dir / "out.txt");
  const double step_secs = std::chrono::duration<double>(Clock::now() - first).count();
  ASSERT_EQ(steps_logged(), 2u) << read_text(dir / "out.txt");
  ::usleep(static_cast<useconds_t>(step_secs * 0.3e6));  // inside step 3's micro-batches
  const auto start = Clock::now();
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const double stop_secs = std::chrono::duration<double>(Clock::now() - start).count();
  const std::string out = read_text(dir / "out.txt");
  std::printf("a step: %.2f s; SIGTERM to exit: %.3f s\n", step_secs, stop_secs);
  EXPECT_LT(stop_secs, 0.5 * step_secs) << out;
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 143) << out;
  EXPECT_NE(out.find("a stop signal cut step 3 short: nothing of it lands"), std::string::npos)
      << out;
  for (const char* rank : {"[rank 0] lockstep: error: stopped by SIGTERM after step 2 ",
                           "[rank 1] lockstep: error: stopped by SIGTERM after step 2 "})
    EXPECT_NE(out.find(rank), std::string::npos) << out;
  EXPECT_EQ(steps_logged(), 2u);
  // Resumed to step 3, it ends at the bytes of a run that was never stopped.
  auto again = test::run_on_ranks(2, "train" + args + " --training.steps 3",
                                  test::Launcher::kLockstepRun);
  ASSERT_EQ(again.code, 0) << again.out;
  std::string straight;
  for (const auto& [k, v] : test::tiny(dir / "straight", 3)) straight += " --" + k + " '" + v + "'";
  straight += accumulation + " --checkpoint.interval 1"
              " --lr_scheduler.decay_type constant " + extra;
  auto ref = test::run_on_ranks(2, "train" + straight, test::Launcher::kLockstepRun);
  ASSERT_EQ(ref.code, 0) << ref.out;
  EXPECT_EQ(read_text(dir / "run/checkpoint/step-3/model.safetensors"),
            read_text(dir / "straight/checkpoint/step-3/model.safetensors"));
}

}  // namespace

// A SIGTERM while the job starts — here rank 0 waits in the rendezvous for a rank 1 that never
// comes — ends it at once with a line on stderr and in the rank's log (before, the default
// action killed it silently after the scheduler's grace period was spent in the wait).
TEST(Reliability, SigtermDuringStartUpEndsAtOnceAndSaysSo) {
  test::TempDir dir;
  std::string args;
  for (const auto& [k, v] : test::tiny(dir / "run", 10)) args += " --" + k + " '" + v + "'";
  const pid_t pid = test::spawn_shell(
      "RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
      std::to_string(test::free_port()) + " exec " + LOCKSTEP_BIN + " train" + args +
      " --comm.init_timeout_seconds 120 >" + dir / "out.txt" + " 2>&1");
  // Rank 0 has claimed the run folder (the lock names its holder) before it waits.
  for (int i = 0; i < 6000 && read_text(dir / "run/.lock").empty(); ++i) ::usleep(5000);
  ::usleep(300000);
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  const std::string out = read_text(dir / "out.txt");
  EXPECT_LT(secs, 5.0) << out;
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 143) << out;
  const std::string line = "lockstep: error: stopped by SIGTERM during start-up";
  EXPECT_NE(out.find(line), std::string::npos) << out;
  EXPECT_NE(read_text(dir / "run/logs/rank0.log").find(line), std::string::npos);
}

TEST(Reliability, SigtermCutsALongAccumulationShortOnTheHostDecidedStep) {
  expect_stop_within_a_micro_batch("");
}

TEST(Reliability, SigtermCutsALongAccumulationShortOnTheDeviceDecidedStep) {
  expect_stop_within_a_micro_batch("--skip.on_global_spike skip --skip.device_decision on");
}

// fsdp gathers with every rank in every forward, so no rank may end its batch alone (issue 42:
// it ignored the signal for the rest of the step, 22.6 s at 2,000 micro-batches): the ranks vote
// at each micro-batch boundary and stop together, as ddp and sharded do. 250 micro-batches:
// fsdp's are the slowest (its gathers), and its three runs took 68 s of the suite at 1,000.
TEST(Reliability, SigtermCutsALongAccumulationShortInFsdp) {
  expect_stop_within_a_micro_batch("--model.name llama --parallelism.mode fsdp", 250);
}

// 32 Gloo ranks on this 2-core machine, each running the step's checks, gradient all-reduce,
// stats exchange and decision on synthetic gradients under random faults (`lockstep bench
// agree`): every rank's verdict equal at every step, and the record form's (own windows, one
// record all-reduced) equal to the table's on every rank; and a rank that decides with another
// threshold is caught at the first step it differs (on 8 ranks: the comparison is the same).
TEST(SkipAgreement, ThirtyTwoGlooRanksDecideAlikeAtEveryStep) {
  const test::CliRun same = test::run_on_ranks(32, "bench agree --steps 60",
                                               test::Launcher::kLockstepRun);
  EXPECT_EQ(same.code, 0) << same.out;
  EXPECT_NE(same.out.find("32 ranks over gloo"), std::string::npos) << same.out;
  EXPECT_NE(same.out.find("every rank decided the same at every step"), std::string::npos)
      << same.out;
  EXPECT_NE(same.out.find("the record form decided as the table at every step on every rank"),
            std::string::npos)
      << same.out;
  const test::CliRun odd = test::run_on_ranks(8, "bench agree --steps 60 --disagree-rank 7",
                                              test::Launcher::kLockstepRun);
  EXPECT_NE(odd.code, 0) << odd.out;
  EXPECT_NE(odd.out.find("the ranks decided differently at step"), std::string::npos) << odd.out;
}

// The record form over MPI's all-reduces (sum and max of int64s): 4 ranks, the same decisions as
// the all-gathered table's at every step on every rank.
TEST(SkipAgreement, TheRecordFormDecidesAsTheTableOverMpi) {
#if !LOCKSTEP_WITH_MPI
  GTEST_SKIP() << "built without MPI";
#endif
  const test::CliRun r = test::capture(
      "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " MPIEXEC
      " --oversubscribe -np 4 " LOCKSTEP_BIN " bench agree --steps 80 --backend mpi");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("4 ranks over mpi"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("the record form decided as the table at every step on every rank"),
            std::string::npos)
      << r.out;
}
