// The step decision (SkipDetector), fault plans, quarantines and their config keys.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "fault.h"
#include "lockstep/config.h"
#include "lockstep/data.h"
#include "lockstep/error.h"
#include "decide/detector.h"
#include "decide/exchange.h"
#include "diag/explain.h"
#include "run_state.h"
#include "detector_util.h"
#include "test_util.h"

using namespace lockstep;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

using test::enabled_policy;
using test::healthy;
using test::warm_up;

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

}  // namespace

TEST(SkipDetector, HealthyStepsStepAndReduceInRankOrder) {
  SkipDetector d(enabled_policy());
  auto ranks = healthy(3, 2.0, 1.5);
  ranks[1].loss = 2.5;
  Verdict v = d.decide(ranks);
  EXPECT_EQ(v.decision, Decision::kStep);
  EXPECT_TRUE(v.reasons == 0u);
  EXPECT_TRUE(v.culprit_ranks.empty());
  EXPECT_DOUBLE_EQ(v.grad_norm, std::sqrt(4.0 / 3 + 4.0 / 3 + 4.0 / 3));
  EXPECT_DOUBLE_EQ(v.loss, (1.5 + 2.5 + 1.5) / 3);
  EXPECT_TRUE(std::isnan(v.grad_norm_z)) << "no z-score before min_history";
}

TEST(SkipDetector, NonfiniteGradientAbortsWhenSkippingIsOffAndNamesTheRank) {
  SkipConfig off;  // the stock behaviour
  SkipDetector d(off);
  auto ranks = healthy(4, 1.0, 2.0);
  ranks[2].local_nonfinite = 17;
  ranks[0].shard_nonfinite = 9;  // after the sync the NaNs sit in whichever shard
  Verdict v = d.decide(ranks);
  EXPECT_EQ(v.decision, Decision::kAbort);
  EXPECT_EQ(v.reasons, core::kNonfiniteGrad);
  EXPECT_EQ(v.culprit_ranks, std::vector<int>{2});
  EXPECT_EQ(v.nonfinite, 9);
  EXPECT_TRUE(std::isnan(v.grad_norm));
  EXPECT_EQ(v.guard, "skip.enabled = false");
}

TEST(SkipDetector, ThresholdsDoNothingWhenSkippingIsOff) {
  SkipConfig off;
  off.max_grad_norm = 0.5;
  SkipDetector d(off);
  EXPECT_EQ(d.decide(healthy(2, 10.0, 1.0)).decision, Decision::kStep);
}

TEST(SkipDetector, NonfiniteLossOnOneRankSkipsAndBlamesIt) {
  SkipDetector d(enabled_policy());
  auto ranks = healthy(3, 1.0, 2.0);
  ranks[1].loss = kNaN;
  ranks[1].bad_samples = 1;
  Verdict v = d.decide(ranks);
  EXPECT_EQ(v.decision, Decision::kSkip);
  EXPECT_EQ(v.reasons, core::kNonfiniteLoss);
  EXPECT_EQ(v.culprit_ranks, std::vector<int>{1});
}

TEST(SkipDetector, MaxGradNormSkipsAndBlamesTheLargestLocalGradient) {
  SkipConfig c = enabled_policy();
  c.max_grad_norm = 5.0;
  SkipDetector d(c);
  EXPECT_EQ(d.decide(healthy(2, 4.9, 1.0)).decision, Decision::kStep);
  auto ranks = healthy(2, 6.0, 1.0);
  ranks[1].local_sumsq = 1000;
  Verdict v = d.decide(ranks);
  EXPECT_EQ(v.decision, Decision::kSkip);
  EXPECT_EQ(v.reasons, core::kGradNormAboveMax);
  EXPECT_EQ(v.culprit_ranks, std::vector<int>{1});
}

TEST(SkipDetector, ZScoresActAfterMinHistoryAndTheOutlierNeverEntersTheWindow) {
  SkipConfig c = enabled_policy();
  SkipDetector d(c);
  warm_up(d, 7);
  // Below min_history: a spike is not judged.
  Verdict early = d.decide(healthy(2, 50.0, 3.0));
  EXPECT_EQ(early.decision, Decision::kStep);
  EXPECT_TRUE(std::isnan(early.grad_norm_z));
  warm_up(d, 5);
  const double mean = d.window().grad_norm_mean, sd = d.window().grad_norm_std;
  const int64_t history = d.history();

  auto spike = healthy(2, 50.0, 3.0);
  spike[1].local_sumsq = 1.0;  // rank 0's own gradient is the big one: a local anomaly
  Verdict v = d.decide(spike);
  EXPECT_EQ(v.decision, Decision::kSkip);
  EXPECT_EQ(v.reasons, core::kGradNormSpike);
  EXPECT_EQ(v.culprit_ranks, std::vector<int>{0});
  EXPECT_GT(v.grad_norm_z, 6.0);
  d.record(v);
  EXPECT_EQ(d.history(), history);
  EXPECT_TRUE(same_bits(d.window().grad_norm_mean, mean));
  EXPECT_TRUE(same_bits(d.window().grad_norm_std, sd));
  EXPECT_EQ(d.consecutive_skips(), 1);

  auto loss_spike = healthy(2, 1.0, 3.0);
  loss_spike[1].loss = 300;
  Verdict l = d.decide(loss_spike);
  EXPECT_EQ(l.decision, Decision::kSkip);
  EXPECT_EQ(l.reasons, core::kLossSpike);
  EXPECT_EQ(l.culprit_ranks, std::vector<int>{1});

  // A normal step after the skips is accepted and resets the run of skips.
  Verdict ok = d.decide(healthy(2, 1.02, 2.98));
  EXPECT_EQ(ok.decision, Decision::kStep);
  d.record(ok);
  EXPECT_EQ(d.consecutive_skips(), 0);
}

TEST(SkipDetector, ConsecutiveGuardTurnsTheNextSkipIntoAnAbort) {
  SkipConfig c = enabled_policy();
  c.max_consecutive = 3;
  SkipDetector d(c);
  auto bad = healthy(2, 1.0, 1.0);
  bad[0].shard_nonfinite = bad[0].local_nonfinite = 1;
  for (int i = 0; i < 3; ++i) {
    Verdict v = d.decide(bad);
    ASSERT_EQ(v.decision, Decision::kSkip) << i;
    d.record(v);
  }
  Verdict v = d.decide(bad);
  EXPECT_EQ(v.decision, Decision::kAbort);
  EXPECT_NE(v.guard.find("max_consecutive = 3: 4 skips in a row"), std::string::npos) << v.guard;
  d.record(v);  // an abort changes nothing
  EXPECT_EQ(d.consecutive_skips(), 3);
}

TEST(SkipDetector, FractionGuardCountsSkipsInTheWindow) {
  SkipConfig c = enabled_policy();
  c.max_fraction = 0.2;
  c.fraction_window = 10;  // at most 2 skips in any 10 steps
  SkipDetector d(c);
  auto bad = healthy(2, 1.0, 1.0);
  bad[1].shard_nonfinite = 4;
  auto step = [&](bool faulty) {
    Verdict v = d.decide(faulty ? bad : healthy(2, 1.0, 1.0));
    d.record(v);
    return v.decision;
  };
  EXPECT_EQ(step(true), Decision::kSkip);
  for (int i = 0; i < 4; ++i) step(false);
  EXPECT_EQ(step(true), Decision::kSkip);
  for (int i = 0; i < 3; ++i) step(false);
  EXPECT_EQ(d.decide(bad).decision, Decision::kAbort) << "third skip within 10 steps";
  step(false);  // the first skip leaves the window
  EXPECT_EQ(step(true), Decision::kSkip);
}

TEST(SkipDetector, StateRoundTripsExactly) {
  SkipConfig c = enabled_policy();
  c.max_fraction = 0.5;
  c.fraction_window = 20;
  SkipDetector a(c);
  warm_up(a, 11, 1.234567891234, 2.718281828459);
  auto bad = healthy(2, 1.0, 1.0);
  bad[0].shard_nonfinite = 1;
  a.record(a.decide(bad));
  SkipDetector b(c);
  b.load_state(nlohmann::json::parse(a.state().dump()));
  EXPECT_EQ(b.state(), a.state());
  auto probe = healthy(2, 1.3, 2.5);
  Verdict va = a.decide(probe), vb = b.decide(probe);
  EXPECT_TRUE(same_bits(va.grad_norm_z, vb.grad_norm_z));
  EXPECT_TRUE(same_bits(va.loss_z, vb.loss_z));
  EXPECT_EQ(b.consecutive_skips(), 1);
}

TEST(FaultPlan, ExplicitAndRandomFaultsAreDeterministic) {
  FaultConfig f;
  f.inject = "nan_grad@3:1, spike@5:0";
  FaultPlan plan(f, 2);
  EXPECT_EQ(plan.at(3, 1), FaultKind::kNanGrad);
  EXPECT_EQ(plan.at(3, 0), FaultKind::kNone);
  EXPECT_EQ(plan.at(5, 0), FaultKind::kSpike);
  EXPECT_FALSE(plan.has_poison());

  f.inject = "";
  f.random_p = 0.1;
  f.random_seed = 7;
  f.random_kinds = "nan_loss, inf_grad";
  FaultPlan r1(f, 4), r2(f, 4);
  int hits = 0;
  for (int s = 1; s <= 2000; ++s)
    for (int r = 0; r < 4; ++r) {
      const FaultKind k = r1.at(s, r);
      EXPECT_EQ(k, r2.at(s, r));
      if (k != FaultKind::kNone) {
        ++hits;
        EXPECT_TRUE(k == FaultKind::kNanLoss || k == FaultKind::kInfGrad) << fault_name(k);
      }
    }
  EXPECT_NEAR(hits / 8000.0, 0.1, 0.02);
  f.random_seed = 8;
  FaultPlan other(f, 4);
  int differ = 0;
  for (int s = 1; s <= 200; ++s) differ += other.at(s, 0) != r1.at(s, 0);
  EXPECT_GT(differ, 0) << "the seed matters";
}

TEST(FaultPlan, BadSpecsAreConfigErrorsNamingTheKey) {
  auto msg = [](std::vector<Override> ov) {
    try {
      load_config("", "test", ov);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(msg({{"fault.inject", "nan_grd@3:0"}}).find("did you mean \"nan_grad\""),
            std::string::npos);
  EXPECT_NE(msg({{"fault.inject", "nan_grad@x:0"}}).find("expected KIND@STEP:RANK"),
            std::string::npos);
  EXPECT_NE(msg({{"fault.inject", "@3:0"}}).find("'fault.inject'"), std::string::npos);
  EXPECT_NE(msg({{"fault.inject", "nan_grad@0:0"}}).find("STEP >= 1"), std::string::npos);
  EXPECT_NE(msg({{"fault.poison_ids", "4, -2"}}).find("'fault.poison_ids'"), std::string::npos);
  EXPECT_NE(msg({{"skip.min_history", "200"}}).find("skip.window = 128"), std::string::npos);
  FaultConfig f;
  f.inject = "nan_grad@3:4";
  try {
    FaultPlan plan(f, 4);
    FAIL() << "rank 4 of 4 accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("use a rank below 4"), std::string::npos) << e.what();
  }
}

TEST(SkipConfig, CommandLineOverridesTheFile) {
  Config c = load_config("[skip]\nenabled = true\nmax_grad_norm = 5.0\nwindow = 64\n", "file.toml",
                         {{"skip.max_grad_norm", "2"}, {"lr_scheduler.on_skip", "hold"}});
  EXPECT_TRUE(c.skip.enabled);
  EXPECT_EQ(c.skip.max_grad_norm, 2.0);
  EXPECT_EQ(c.skip.window, 64);
  EXPECT_EQ(c.lr_scheduler.on_skip, OnSkip::kHold);
  EXPECT_FALSE(load_config("", "x").skip.enabled) << "skipping is opt-in";
}

TEST(Quarantine, ExcludedSamplesAreNeverDrawnAndRanksStayDisjoint) {
  auto src = make_synthetic_source(1 << 16);
  const int W = 3;
  std::vector<Sampler> samplers;
  for (int r = 0; r < W; ++r) samplers.emplace_back(*src, SamplerOptions{32, 4, r, W, 11});
  std::vector<int64_t> excluded;
  for (int i = 0; i < 40; ++i) excluded.push_back(samplers[0].sample_at(i * 3));
  for (auto& s : samplers) s.set_excluded(excluded, "q.txt");
  for (int step = 0; step < 50; ++step) {
    std::vector<int64_t> seen;
    for (auto& s : samplers)
      for (int64_t id : s.next_ids()) {
        EXPECT_EQ(std::count(excluded.begin(), excluded.end(), id), 0) << id;
        seen.push_back(id);
      }
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end()) << "step " << step;
    EXPECT_EQ(samplers[0].position(), samplers[2].position());
  }
  Sampler s(*src, SamplerOptions{32, 4, 0, 1, 11});
  EXPECT_THROW(s.set_excluded({s.num_samples()}, "q.txt"), InputError);
}

TEST(Quarantine, IdFileReadsCommentsAndRejectsGarbage) {
  test::TempDir dir;
  test::write_bytes(dir / "q.txt", "# header\n12\n  7  # why\n\n3\n");
  EXPECT_EQ(read_id_file(dir / "q.txt"), (std::vector<int64_t>{12, 7, 3}));
  test::write_bytes(dir / "bad.txt", "12\nseven\n");
  try {
    read_id_file(dir / "bad.txt");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.txt' line 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_id_file(dir / "missing.txt"), InputError);
}

// Quarantine only on sample-level evidence (issue 25): a culprit batch that reproduced its
// anomaly with no sample standing out is suspect, not quarantined (on main the whole batch of an
// innocent rank, caught up in a real instability, was quarantined); a global anomaly blames no
// sample even when losses are NaN everywhere.
TEST(Quarantine, OnlySampleLevelEvidenceQuarantines) {
  SampleTable t;
  t.ids = {{10, 11, 12, 13}, {20, 21, 22, 23}};
  t.losses = {{2.0, 2.1, 1.9, 2.0}, {2.0, 2.05, 1.95, 2.02}};
  Verdict v;
  v.scope = core::kLocal;
  v.cause = kCauseData;  // the replay reproduced rank 1's elevated gradient
  v.culprit_ranks = {1};
  SampleEvidence e = judge_samples(v, t, 6.0);
  EXPECT_TRUE(e.quarantine.empty()) << "a reproduction is no evidence against any one sample";
  EXPECT_EQ(e.suspect, (std::vector<int64_t>{20, 21, 22, 23}));
  // A sample whose own loss is NaN, or far above its batch's: quarantined, its batch-mates not.
  t.losses[1] = {2.0, kNaN, 1.95, 40.0};
  e = judge_samples(v, t, 6.0);
  EXPECT_EQ(e.quarantine, (std::vector<int64_t>{21, 23}));
  EXPECT_TRUE(e.suspect.empty());
  // Three finite losses close together: their deviation says nothing; an ordinary sample 3 %
  // above its batch-mates is not quarantined with the NaN one (it was, on llama's batches).
  t.losses[1] = {kNaN, 5.8075, 5.8218, 5.9781};
  e = judge_samples(v, t, 6.0);
  EXPECT_EQ(e.quarantine, (std::vector<int64_t>{20}));
  // Without a replay (cause unknown) a batch with no outlier names nobody.
  t.losses[1] = {2.0, 2.05, 1.95, 2.02};
  v.cause = "";
  e = judge_samples(v, t, 6.0);
  EXPECT_TRUE(e.quarantine.empty() && e.suspect.empty());
  // Every sample of the culprit's batch nonfinite: the model or the rank, not a sample (a NaN
  // weight made them so): nothing quarantined (issue 42); one NaN among finite ones still is.
  t.losses[1] = {kNaN, kNaN, kNaN, kNaN};
  v.cause = "";
  e = judge_samples(v, t, 6.0);
  EXPECT_TRUE(e.quarantine.empty() && e.suspect.empty()) << e.quarantine.size();
  // A global instability never quarantines, not even NaN losses.
  t.losses = {{kNaN, kNaN, kNaN, kNaN}, {kNaN, kNaN, kNaN, kNaN}};
  v.scope = core::kGlobal;
  v.cause = kCauseInstability;
  v.culprit_ranks = {0, 1};
  e = judge_samples(v, t, 6.0);
  EXPECT_TRUE(e.quarantine.empty() && e.suspect.empty());
}

// Sample ids and losses come from the caller (the PyTorch guard): ids shorter than the losses
// were read past their end and a pointer-like id landed in the events and the quarantine
// (issue 38). Now a table whose rows differ in length is refused, naming the rank.
TEST(Quarantine, IdsAndLossesOfDifferentLengthsAreRefusedNamingTheRank) {
  SampleTable t;
  t.ids = {{10, 11, 12, 13}, {20}};
  t.losses = {{2.0, 2.1, 1.9, 2.0}, {kNaN, 2.0, 2.0, 2.0}};
  Verdict v;
  v.scope = core::kLocal;
  v.cause = kCauseData;
  v.culprit_ranks = {1};
  try {
    judge_samples(v, t, 6.0);
    FAIL() << "a row with 1 id and 4 losses was judged";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 gave 1 sample ids and 4 sample losses"),
              std::string::npos)
        << e.what();
  }
  t.ids[1] = {20, 21, 22, 23};
  EXPECT_EQ(judge_samples(v, t, 6.0).quarantine, (std::vector<int64_t>{20}));
}

// The counters of a decided step (run_state.h's count): a skip or an abort drops nothing from
// an update, so only a salvage counts its dropped ranks (issue 25: dropped_contributions grew
// on skipped steps).
TEST(RunCounters, OnlyASalvageCountsDroppedContributions) {
  RunCounters c;
  Verdict v;
  v.dropped_ranks = {1, 3};
  for (Decision d : {Decision::kSkip, Decision::kAbort, Decision::kSalvage}) {
    v.decision = d;
    count(c, v, 10, 0);
  }
  EXPECT_EQ(c.dropped_contributions, 2);
  EXPECT_EQ(c.salvaged_steps, 1);
  EXPECT_EQ(c.skipped_steps, 1);
  EXPECT_EQ(c.step, 3);
}

// A step a stop signal cut short (a rank's stop_requested = 2: its gradient is partial) is
// neither an update nor a skip: the core blocks it (found_inf = 1) and makes every later
// decision block too (the run stops), the windows, guards and counters do not move, and nothing
// is named (issue 25: bounded stop).
TEST(SkipDetector, AStepAStopCutShortIsNeitherTakenNorCounted) {
  SkipDetector d(test::enabled_policy(), TrainingConfig{}, 2);
  test::warm_up(d, 40);
  const int64_t history = d.history();
  auto table = test::healthy(2, 50.0, 30.0);  // a spike too: the interruption comes first
  table[1].stop_requested = 2;
  HostDecideState st = d.state_for(2);  // the device's copy, before the host records the step
  const Verdict v = d.decide(table);
  EXPECT_TRUE(v.interrupted);
  EXPECT_TRUE(v.stop);
  EXPECT_EQ(v.decision, Decision::kSkip);
  EXPECT_TRUE(v.reasons == 0u);
  EXPECT_TRUE(v.culprit_ranks.empty());
  d.record(v);
  EXPECT_EQ(d.history(), history);
  EXPECT_EQ(d.consecutive_skips(), 0);
  // The device's form: blocked now and at every later step.
  core::DecideResult r{};
  float found_inf = 0, grad_scale = 0;
  core::decide_step(reinterpret_cast<const double*>(table.data()), 2, st.s, d.config(), r,
                    &found_inf, &grad_scale);
  EXPECT_EQ(r.interrupted, 1);
  EXPECT_EQ(found_inf, 1.0f);
  EXPECT_EQ(st.s.grad_norms.size, history);
  const auto clean = test::healthy(2, 1.0, 3.0);
  core::decide_step(reinterpret_cast<const double*>(clean.data()), 2, st.s, d.config(), r,
                    &found_inf, &grad_scale);
  EXPECT_EQ(found_inf, 1.0f) << "no update lands after an interrupted step";
}

// ZClip's rule (skip.adaptive_clip = "zclip", arXiv 2504.02507): after its warm-up the global
// norm is tested against an EMA of its mean and variance and clipped to mean + z_t^2 std / z —
// the numbers of ZClip's reference (two-pass warm-up statistics, then the EMA of the norm as
// taken), checked here against that arithmetic written out; the state travels in checkpoints and
// a nonfinite norm never enters it; a local anomaly is still skipped and named.
TEST(ZClip, ClipsTheGlobalNormAsZClipsReferenceDoes) {
  SkipConfig cfg = enabled_policy();
  cfg.adaptive_clip = AdaptiveClip::kZClip;
  cfg.grad_norm_zscore = 0;  // the window's tests off: ZClip alone
  cfg.loss_zscore = 0;
  const TrainingConfig training;
  SkipDetector d(cfg, training, 1);
  std::vector<double> warm;
  for (int i = 0; i < 25; ++i) {  // ZClip's warm-up: no clip, the statistics gather
    const double g = 1.0 + 0.02 * ((i * 7) % 5);
    Verdict v = d.decide(healthy(1, g, 3.0));
    ASSERT_EQ(v.decision, Decision::kStep) << i;
    d.record(v);
    warm.push_back(g);
  }
  double mean = 0, var = 0;
  for (double g : warm) mean += g / 25;
  for (double g : warm) var += (g - mean) * (g - mean) / 25;
  const double g = 1.6, z = (g - mean) / (std::sqrt(var) + 1e-6);
  ASSERT_GT(z, 2.5);
  Verdict v = d.decide(healthy(1, g, 3.0));
  EXPECT_EQ(v.decision, Decision::kClip);
  EXPECT_EQ(v.reasons, core::kGradNormZClip);
  const double bound = mean + 2.5 * std::sqrt(var) / (z / 2.5);
  EXPECT_NEAR(v.clip_to, bound, 1e-12 * bound);
  EXPECT_LT(v.clip, 1.0);
  d.record(v);
  mean = 0.97 * mean + 0.03 * bound;  // the EMA takes the norm as taken: the bound
  var = 0.97 * var + 0.03 * (bound - mean) * (bound - mean);
  const nlohmann::json after = d.state();
  EXPECT_NEAR(after["zclip"]["mean"].get<double>(), mean, 1e-12);
  EXPECT_NEAR(after["zclip"]["var"].get<double>(), var, 1e-12);
  // A nonfinite gradient is skipped and never enters the statistics.
  auto bad = healthy(1, 1.0, 3.0);
  bad[0].shard_nonfinite = 3;
  v = d.decide(bad);
  EXPECT_EQ(v.decision, Decision::kSkip);
  d.record(v);
  EXPECT_EQ(d.state()["zclip"], after["zclip"]);
  // Checkpointed: a detector restored from the state takes the next decision bit for bit.
  SkipDetector restored(cfg, training, 1);
  restored.load_state(nlohmann::json::parse(d.state().dump()));
  const Verdict a = d.decide(healthy(1, 2.0, 3.0)), b = restored.decide(healthy(1, 2.0, 3.0));
  EXPECT_EQ(a.decision, Decision::kClip);
  EXPECT_TRUE(same_bits(a.clip_to, b.clip_to));
  EXPECT_TRUE(same_bits(a.clip, b.clip));
}

TEST(ZClip, ALocalAnomalyIsStillSkippedAndTheKeyNeedsSkipping) {
  SkipConfig cfg = enabled_policy();
  cfg.adaptive_clip = AdaptiveClip::kZClip;
  cfg.zclip_warmup = 8;
  const TrainingConfig training;
  SkipDetector d(cfg, training, 3);
  warm_up(d, 30, 1.0, 3.0, 3);
  auto t = healthy(3, 1.0, 3.0);
  t[2].local_sumsq *= 2500;  // rank 2's own gradient, and its share of the synced one
  t[2].shard_sumsq *= 2500;
  const Verdict v = d.decide(t);
  EXPECT_EQ(v.decision, Decision::kSkip);
  EXPECT_EQ(v.scope, core::kLocal);
  EXPECT_EQ(v.culprit_ranks, std::vector<int>{2});
  try {
    load_config("[skip]\nadaptive_clip = \"zclip\"\n", "t.toml");
    ADD_FAILURE() << "zclip without skipping was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("skip.adaptive_clip"), std::string::npos) << e.what();
  }
  EXPECT_EQ(load_config("[skip]\nenabled = true\nadaptive_clip = \"zclip\"\n", "t.toml")
                .skip.zclip_zscore,
            2.5);
}
