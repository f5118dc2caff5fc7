// The policies beyond the window's z-tests (issue: evidence that the decision helps): AdaGC's
// per-tensor clip (skip.adaptive_clip = "adagc"), SPAM's moment reset of the tensors a global
// spike hit (skip.spike_moment_reset), and the consecutive-skip guard stated in tokens and in
// compute seconds. The rules are checked against their arithmetic written out; the runs show
// them acting in training, resuming bit for bit, and refusing what they cannot honour.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "decide/detector.h"
#include "decide/tensor_policies.h"
#include "detector_util.h"
#include "lockstep/config.h"
#include "lockstep/error.h"
#include "lockstep/train.h"
#include "run_util.h"

using namespace lockstep;
using test::CliRun;
using test::job;
using test::Launcher;
using test::meta;
using test::read_jsonl;
using test::read_text;

namespace {

SkipConfig adagc(int warmup) {
  SkipConfig k = test::enabled_policy();
  k.adaptive_clip = AdaptiveClip::kAdaGC;
  k.adagc_warmup = warmup;
  return k;
}

Verdict taken(double clip = 1.0) {
  Verdict v;
  v.decision = clip < 1.0 ? Decision::kClip : Decision::kStep;
  v.clip = clip;
  return v;
}

Verdict global_spike_skip() {
  Verdict v;
  v.decision = Decision::kSkip;
  v.scope = core::kGlobal;
  v.reasons = core::kGradNormSpike;
  return v;
}

}  // namespace

// During the warm-up each tensor's threshold is the smallest of its norms and nothing is
// clipped; after it a tensor above lambda x its threshold is scaled to that bound, the others
// are not, and the threshold moves by the EMA of the norm as taken (the clipped one).
TEST(AdaGC, WarmsUpOnTheMinimumThenClipsEachTensorToItsOwnBound) {
  TensorPolicies p(adagc(3), {"a", "b"}, nullptr);
  for (const auto& norms : {std::vector<double>{2.0, 1.0}, {1.5, 1.2}, {1.8, 0.9}}) {
    Verdict v = taken();
    EXPECT_TRUE(p.decide(norms, v).factors.empty());
    EXPECT_EQ(v.tensors_clipped, 0);
  }
  EXPECT_EQ(p.thresholds(), (std::vector<double>{1.5, 0.9}));
  Verdict v = taken();
  const TensorActions a = p.decide({15.0, 0.9}, v);  // tensor a spikes alone
  ASSERT_EQ(a.factors.size(), 1u);
  const double bound = 1.05 * 1.5;
  EXPECT_DOUBLE_EQ(a.factors.at("a"), bound / 15.0);
  EXPECT_EQ(v.tensors_clipped, 1);
  EXPECT_DOUBLE_EQ(p.thresholds()[0], 0.98 * 1.5 + 0.02 * bound);
  EXPECT_DOUBLE_EQ(p.thresholds()[1], 0.98 * 0.9 + 0.02 * 0.9);
}

// The norms are those of the update the global decision takes: a global clip comes first.
TEST(AdaGC, TheGlobalClipComesFirst) {
  TensorPolicies p(adagc(1), {"a"}, nullptr);
  Verdict v = taken();
  p.decide({1.0}, v);
  v = taken(0.1);
  EXPECT_TRUE(p.decide({10.0}, v).factors.empty()) << "10 x 0.1 is within 1.05 x 1";
  v = taken(0.5);
  EXPECT_DOUBLE_EQ(p.decide({10.0}, v).factors.at("a"), 1.05 * 1.0 / 5.0);
}

// Only taken steps move the thresholds, and a nonfinite norm never enters one.
TEST(AdaGC, SkipsAndNonfiniteNormsNeverEnterTheThresholds) {
  TensorPolicies p(adagc(2), {"a", "b"}, nullptr);
  Verdict v = taken();
  p.decide({1.0, 2.0}, v);
  const auto before = p.thresholds();
  Verdict skip = global_spike_skip();
  p.decide({50.0, 50.0}, skip);
  EXPECT_EQ(p.thresholds(), before);
  EXPECT_EQ(p.taken(), 1);
  v = taken();
  p.decide({std::nan(""), 1.5}, v);
  EXPECT_EQ(p.thresholds()[0], before[0]);
  EXPECT_EQ(p.thresholds()[1], 1.5);
}

// A global spike skipped or clipped resets the moments of the tensors above their bound only;
// a local anomaly (one rank's batch) or a nonfinite value resets nothing.
TEST(SpikeReset, AGlobalSpikeResetsTheMomentsOfTheTensorsItHit) {
  SkipConfig k = test::enabled_policy();
  k.spike_moment_reset = true;
  TensorPolicies p(k, {"a", "b", "c"}, nullptr);
  for (int i = 0; i < 5; ++i) {
    Verdict v = taken();
    const TensorActions a = p.decide({1.0, 1.0, 1.0}, v);
    EXPECT_TRUE(a.factors.empty()) << "the reset alone clips nothing";
  }
  Verdict v = global_spike_skip();
  TensorActions a = p.decide({30.0, 1.0, 2.0}, v);
  EXPECT_EQ(a.reset, (std::unordered_set<std::string>{"a", "c"}));
  EXPECT_EQ(v.moments_reset, (std::vector<std::string>{"a", "c"}));
  Verdict clip = global_spike_skip();
  clip.decision = Decision::kClip;
  clip.clip = 0.1;
  EXPECT_EQ(p.decide({30.0, 1.0, 1.0}, clip).reset, (std::unordered_set<std::string>{"a"}));
  Verdict local = global_spike_skip();
  local.scope = core::kLocal;
  EXPECT_TRUE(p.decide({30.0, 30.0, 30.0}, local).reset.empty());
  Verdict nan = global_spike_skip();
  nan.reasons = core::kNonfiniteGrad | core::kGradNormSpike;
  EXPECT_TRUE(p.decide({30.0, 30.0, 30.0}, nan).reset.empty());
}

// The thresholds travel in checkpoints: a restored policy takes the next decisions bit for bit;
// a checkpoint of another model is refused naming the tensor.
TEST(AdaGC, TheStateRoundTripsAndAnotherModelsIsRefused) {
  TensorPolicies p(adagc(2), {"a", "b"}, nullptr);
  for (double g : {1.0, 0.7, 0.9, 1.1}) {
    Verdict v = taken();
    p.decide({g, 2 * g}, v);
  }
  TensorPolicies q(adagc(2), {"a", "b"}, nullptr);
  q.load_state(nlohmann::json::parse(p.state().dump()));
  Verdict v1 = taken(), v2 = taken();
  const TensorActions x = p.decide({9.0, 1.0}, v1), y = q.decide({9.0, 1.0}, v2);
  ASSERT_EQ(x.factors.size(), 1u);
  EXPECT_EQ(std::memcmp(&x.factors.at("a"), &y.factors.at("a"), sizeof(double)), 0);
  EXPECT_EQ(p.state(), q.state());
  TensorPolicies other(adagc(2), {"a", "z"}, nullptr);
  try {
    other.load_state(p.state());
    ADD_FAILURE() << "another model's thresholds were accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(" z;"), std::string::npos) << e.what();
  }
}

// skip.max_consecutive_seconds: the skips in a row abort once their compute (the slowest
// rank's, from the exchanged table) exceeds the budget, with a message in those units.
TEST(Guards, TheConsecutiveGuardInComputeSeconds) {
  SkipConfig k = test::enabled_policy();
  k.max_consecutive_seconds = 1.0;
  SkipDetector d(k, TrainingConfig{}, 2);
  auto bad = test::healthy(2, 1.0, 3.0);
  bad[1].shard_nonfinite = 1;
  bad[0].compute_seconds = 0.3;
  bad[1].compute_seconds = 0.4;  // the slowest rank's counts
  for (int i = 0; i < 2; ++i) {
    const Verdict v = d.decide(bad);
    ASSERT_EQ(v.decision, Decision::kSkip) << i;
    d.record(v);
  }
  const Verdict v = d.decide(bad);
  EXPECT_EQ(v.decision, Decision::kAbort);
  EXPECT_EQ(v.guard, "skip.max_consecutive_seconds = 1.0: 3 skips in a row cost 1.2 s of compute");
  // A taken step starts the count again; the count travels in checkpoints.
  auto clean = test::healthy(2, 1.0, 3.0);
  d.record(d.decide(clean));
  d.record(d.decide(bad));
  SkipDetector restored(k, TrainingConfig{}, 2);
  restored.load_state(nlohmann::json::parse(d.state().dump()));
  EXPECT_EQ(restored.state()["consecutive_skip_seconds"], 0.4);
  EXPECT_EQ(restored.decide(bad).decision, Decision::kSkip);
}

// skip.max_consecutive_tokens becomes steps of the run's global batch (the tighter guard acts);
// fewer tokens than one step's is refused naming the key and the least that works.
TEST(Guards, TheConsecutiveGuardInTokens) {
  SkipConfig k;
  k.max_consecutive = 10;
  k.max_consecutive_tokens = 20000;
  EXPECT_EQ(with_token_guard(k, 4096).max_consecutive, 4);
  EXPECT_EQ(with_token_guard(k, 4096).max_consecutive_tokens, 20000) << "the tokens act";
  EXPECT_EQ(with_token_guard(k, 1024).max_consecutive, 10);
  EXPECT_EQ(with_token_guard(k, 1024).max_consecutive_tokens, 0) << "the steps act";
  k.max_consecutive = 0;
  EXPECT_EQ(with_token_guard(k, 1024).max_consecutive, 19);
  k.max_consecutive_tokens = 1000;
  try {
    with_token_guard(k, 4096);
    ADD_FAILURE() << "a guard below one step was accepted";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("skip.max_consecutive_tokens"), std::string::npos) << what;
    EXPECT_NE(what.find("at least 4096"), std::string::npos) << what;
  }
}

// In a run: 2 skips of 128 tokens each pass a 300-token guard, the third aborts the run with
// the guard named; a resumed AdaGC run clips the same tensors at the same steps and ends with
// the same weights as the uninterrupted one.
TEST(PolicyRun, TheTokenGuardAbortsARunOnItsThirdSkipInARow) {
  test::TempDir dir;
  const Config c = job(dir.path(), 12,
                       {{"skip.max_consecutive", "0"},
                        {"skip.max_consecutive_tokens", "300"},
                        {"fault.inject", "nan_grad@5:0, nan_grad@6:0, nan_grad@7:0"}});
  try {
    train(c);
    ADD_FAILURE() << "the third skip in a row did not abort";
  } catch (const TrainingAborted& e) {
    EXPECT_NE(std::string(e.what()).find("skip.max_consecutive_tokens = 300 (2 steps of the "
                                         "global batch): 3 skips in a row"),
              std::string::npos)
        << e.what();
  }
}

TEST(PolicyRun, AResumedAdaGCRunClipsAsTheUninterruptedOne) {
  test::TempDir dir;
  const std::vector<Override> policy = {{"skip.adaptive_clip", "adagc"},
                                        {"skip.adagc_warmup", "5"},
                                        {"checkpoint.interval", "10"},
                                        {"fault.inject", "spike@14:0, spike@24:0"},
                                        {"fault.spike_factor", "4"}};
  train(job(dir / "full", 30, policy));
  std::filesystem::create_directories(dir / "resumed/checkpoint");
  std::filesystem::copy(dir / "full/checkpoint/step-20", dir / "resumed/checkpoint/step-20",
                        std::filesystem::copy_options::recursive);
  auto resumed = policy;
  resumed.push_back({"checkpoint.load_step", "20"});
  EXPECT_EQ(train(job(dir / "resumed", 30, resumed)).start_step, 20);
  const nlohmann::json full = meta(dir / "full/checkpoint/step-30");
  EXPECT_GT(full["tensor_clips"].get<int64_t>(), 0) << "AdaGC clipped some tensor";
  EXPECT_EQ(meta(dir / "resumed/checkpoint/step-30")["detector"]["tensors"],
            full["detector"]["tensors"]);
  EXPECT_EQ(meta(dir / "resumed/checkpoint/step-30")["tensor_clips"], full["tensor_clips"]);
  EXPECT_EQ(read_text(dir / "resumed/checkpoint/step-30/model.safetensors"),
            read_text(dir / "full/checkpoint/step-30/model.safetensors"));
  const auto metrics = read_jsonl(dir / "full/metrics.jsonl");
  int64_t at_24 = -1, at_23 = -1;
  for (const auto& m : metrics) {
    if (m.value("step", 0) == 23) at_23 = m["tensor_clips"].get<int64_t>();
    if (m.value("step", 0) == 24) at_24 = m["tensor_clips"].get<int64_t>();
  }
  EXPECT_GT(at_24, at_23) << "the spike's tensors were clipped at its step";
}

// A global spike skipped with the reset on: the event names the tensors, their AdamW moments
// are zero in the next checkpoint (the step counts unchanged), the weights untouched.
TEST(PolicyRun, ASkippedGlobalSpikeZeroesTheMomentsOfTheTensorsItHit) {
  test::TempDir dir;
  train(job(dir.path(), 12,
            {{"skip.spike_moment_reset", "true"},
             {"skip.on_global_spike", "skip"},
             {"skip.max_grad_norm", "50"},
             {"checkpoint.interval", "1"},
             {"fault.inject", "spike@8:0"},
             {"fault.spike_factor", "1000"}}));
  const auto events = read_jsonl(dir / "diagnostics/rank0.jsonl");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0]["decision"], "skip");
  EXPECT_EQ(events[0]["scope"], "global");
  const auto reset = events[0].at("moments_reset").get<std::vector<std::string>>();
  ASSERT_FALSE(reset.empty());
  EXPECT_EQ(meta(dir / "checkpoint/step-8")["moment_resets"],
            static_cast<int64_t>(reset.size()));
  EXPECT_EQ(read_text(dir / "checkpoint/step-8/model.safetensors"),
            read_text(dir / "checkpoint/step-7/model.safetensors"))
      << "a skip leaves the weights";
  MappedSafetensors before(dir / "checkpoint/step-7/optimizer.safetensors");
  MappedSafetensors after(dir / "checkpoint/step-8/optimizer.safetensors");
  for (const std::string& name : reset) {
    for (const char* m : {".exp_avg", ".exp_avg_sq"}) {
      const TensorView& v = after.at(name + m);
      const std::vector<char> zeros(v.bytes, 0);
      EXPECT_EQ(std::memcmp(v.data, zeros.data(), v.bytes), 0) << name << m;
    }
    const TensorView& s0 = before.at(name + ".step");
    const TensorView& s1 = after.at(name + ".step");
    EXPECT_EQ(std::memcmp(s0.data, s1.data, s0.bytes), 0) << "a skip keeps the step count";
  }
}

// What cannot be honoured is refused: the per-tensor policies need skipping on.
TEST(PolicyRun, ThePerTensorPoliciesNeedSkipping) {
  for (const char* text : {"[skip]\nadaptive_clip = \"adagc\"\n",
                           "[skip]\nspike_moment_reset = true\n"}) {
    try {
      load_config(text, "t.toml");
      ADD_FAILURE() << text;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("set skip.enabled = true"), std::string::npos)
          << e.what();
    }
  }
}

// On 2 ranks every rank gathers the same per-tensor sums and clips the same tensors: the replicas
// agree every step (diagnostics.verify_every), and ddp and sharded (whose ranks check the same
// blocks) end with the same weights bit for bit.
TEST(PolicyRun, TwoRanksClipTheSameTensorsInDdpAndSharded) {
  test::TempDir dir;
  const std::string args =
      " --model.dim 32 --model.n_heads 2 --model.n_layers 2 --model.max_seq_len 32"
      " --training.seq_len 32 --training.local_batch_size 4 --training.threads 1"
      " --training.steps 24 --metrics.log_freq 1 --checkpoint.enable false"
      " --diagnostics.verify_every 1 --skip.enabled true --skip.adaptive_clip adagc"
      " --skip.adagc_warmup 4 --skip.spike_moment_reset true --skip.max_grad_norm 30"
      " --fault.inject 'spike@12:0, spike@12:1, spike@18:1' --fault.spike_factor 50";
  std::vector<std::string> crcs;
  for (const std::string mode : {"ddp", "sharded"}) {
    const std::string run = dir / mode;
    const CliRun r = test::run_on_ranks(
        2, "train --job.dump_folder " + run + " --parallelism.mode " + mode + args,
        Launcher::kLockstepRun);
    ASSERT_EQ(r.code, 0) << r.out;
    nlohmann::json last;
    for (const auto& m : read_jsonl(run + "/metrics.jsonl"))
      if (m.contains("tensor_clips")) last = m;
    ASSERT_EQ(last.value("step", 0), 24) << mode;
    EXPECT_GT(last["tensor_clips"].get<int64_t>(), 0) << mode;
    EXPECT_GT(last["moment_resets"].get<int64_t>(), 0) << mode << ": step 12's spike";
    const auto o = test::outcome(run, 2);
    EXPECT_EQ(o.crcs.at(0), o.crcs.at(1)) << mode;
    crcs.push_back(o.crcs.at(0));
  }
  EXPECT_EQ(crcs[0], crcs[1]) << "ddp and sharded clip the same tensors by the same factors";
}
