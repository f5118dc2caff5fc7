// There is one decision (src/decide/core/): the host's SkipDetector holds the core's state and
// calls the core, adding names; decide_step, the form the device runs (decide_global on one
// thread, then record_rank per rank), must take the host's decisions bit for bit over long
// random runs with faults on one rank and spikes on all, guards and fp16 loss scaling, under
// each skip.on_global_spike: the numbers, the outcome, the trainer's clip, and the whole state
// (every ring, the guards, the loss scale) byte for byte. An abort is sticky. And the exchanged
// row built where the tensors live is the host's.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <vector>

#include "decide/core/step.h"
#include "decide/core/tensors.h"
#include "decide/detector.h"
#include "decide/device_decision.h"
#include "decide/exchange.h"
#include "decide/names.h"
#include "detector_util.h"
#include "optim/adamw.h"

using namespace lockstep;

namespace {

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// A device-style state: its rings in a host vector.
struct DeviceState {
  std::vector<double> rings;
  core::DecideState s;
  DeviceState(int64_t window, int64_t fraction_window, int world, double scale)
      : rings(core::decide_state_doubles(window, fraction_window, world), 0.0),
        s(core::fresh_decide_state(rings.data(), window, fraction_window, world, scale)) {}
};

// The host guard's name for the core's `why`.
std::string guard_prefix(core::Why why) {
  switch (why) {
    case core::kMaxConsecutive: return "skip.max_consecutive";
    case core::kMaxFraction: return "skip.max_fraction";
    case core::kMaxSeconds: return "skip.max_consecutive_seconds";
    case core::kMaxOverflows: return "training.loss_scale_max_overflows";
    case core::kScaleMin: return "training.loss_scale_min";
    case core::kSkipDisabled: return "skip.enabled = false";
    case core::kGlobalSpikeAbort: return "skip.on_global_spike = abort";
    default: return "";
  }
}

struct Policy {
  bool enabled;
  const char* scaling;
  OnGlobalSpike on_global_spike;
  AdaptiveClip adaptive_clip = AdaptiveClip::kOff;
  double max_seconds = 0;  // skip.max_consecutive_seconds (the table then carries compute times)
};

struct Counts {
  int taken = 0, skipped = 0, clipped = 0, aborted = 0, global_aborts = 0, overflows = 0;
  int seconds_aborts = 0;
};

// The device's state is the host's, byte for byte: every ring (global, recent, each rank's own,
// the scratch), the guards and the loss scale.
void expect_same_state(const DeviceState& dev, const SkipDetector& detector, int world,
                       const std::string& at) {
  const HostDecideState host = detector.state_for(world);
  ASSERT_EQ(host.rings.size(), dev.rings.size()) << at;
  EXPECT_EQ(std::memcmp(host.rings.data(), dev.rings.data(), dev.rings.size() * sizeof(double)),
            0)
      << at;
  const core::DecideState& h = host.s;
  for (const auto& [d, w] : {std::pair{dev.s.grad_norms, h.grad_norms},
                             std::pair{dev.s.losses, h.losses}, std::pair{dev.s.recent, h.recent}})
    EXPECT_TRUE(d.head == w.head && d.size == w.size) << at;
  EXPECT_TRUE(same_bits(dev.s.scale.scale, h.scale.scale)) << at;
  EXPECT_EQ(dev.s.scale.growth_tracker, h.scale.growth_tracker) << at;
  EXPECT_EQ(dev.s.scale.consecutive_overflows, h.scale.consecutive_overflows) << at;
  EXPECT_EQ(dev.s.consecutive_skips, h.consecutive_skips) << at;
  EXPECT_TRUE(same_bits(dev.s.consecutive_skip_seconds, h.consecutive_skip_seconds)) << at;
  EXPECT_EQ(dev.s.recent_skips, h.recent_skips) << at;
  EXPECT_EQ(dev.s.zclip.count, h.zclip.count) << at;
  for (const auto& [d, w] : {std::pair{dev.s.zclip.mean, h.zclip.mean},
                             std::pair{dev.s.zclip.m2, h.zclip.m2},
                             std::pair{dev.s.zclip.var, h.zclip.var}})
    EXPECT_TRUE(same_bits(d, w)) << at;
}

// One step decided both ways; false after an abort (the run ends).
bool decide_both(const std::vector<RankStats>& table, SkipDetector& detector, DeviceState& dev,
                 const TrainingConfig& training, const core::DecideConfig& config, Counts& n,
                 const std::string& at) {
  const int world = static_cast<int>(table.size());
  const Verdict v = detector.decide(table);
  std::vector<double> flat(table.size() * core::kStatsDoubles);
  std::memcpy(flat.data(), table.data(), flat.size() * sizeof(double));
  core::DecideResult r{};
  float found_inf = -1, grad_scale = -1;
  core::decide_step(flat.data(), world, dev.s, config, r, &found_inf, &grad_scale);

  EXPECT_TRUE(same_bits(r.grad_norm, v.grad_norm)) << at;
  EXPECT_TRUE(same_bits(r.loss, v.loss)) << at;
  EXPECT_TRUE(same_bits(r.grad_norm_z, v.grad_norm_z)) << at;
  EXPECT_TRUE(same_bits(r.loss_z, v.loss_z)) << at;
  EXPECT_TRUE(same_bits(r.loss_scale, v.loss_scale)) << at;
  EXPECT_EQ(r.overflow != 0, v.overflow) << at;
  const Decision taken = r.clipped ? Decision::kClip : Decision::kStep;
  const Decision want = r.outcome == core::kTake       ? taken
                        : r.outcome == core::kSkipStep ? Decision::kSkip
                                                       : Decision::kAbort;
  EXPECT_EQ(decision_name(want), std::string(decision_name(v.decision))) << at;
  const bool take = v.decision == Decision::kStep || v.decision == Decision::kClip;
  EXPECT_EQ(found_inf, take ? 0.0f : 1.0f) << at;
  if (v.decision == Decision::kAbort) {
    EXPECT_EQ(v.why, r.why) << at;
    EXPECT_FALSE(guard_prefix(r.why).empty()) << at << ": why " << static_cast<int>(r.why);
    EXPECT_EQ(v.guard.rfind(guard_prefix(r.why), 0), 0u) << at << ": " << v.guard;
    // Sticky: whatever comes next, nothing is updated.
    core::decide_step(flat.data(), world, dev.s, config, r, &found_inf, &grad_scale);
    EXPECT_EQ(r.outcome, core::kAbortRun) << at;
    EXPECT_EQ(r.why, core::kStickyAbort) << at;
    EXPECT_EQ(found_inf, 1.0f) << at;
    ++n.aborted;
    n.global_aborts += v.why == core::kGlobalSpikeAbort ? 1 : 0;
    n.seconds_aborts += v.why == core::kMaxSeconds ? 1 : 0;
    return false;
  }
  // The clip the trainer applies (the verdict's), against training.max_norm by hand.
  const double clip =
      take ? clip_coefficient(v.grad_norm, core::clip_limit(v.clip_to, training.max_norm))
           : 1.0;
  EXPECT_TRUE(same_bits(v.clip, clip)) << at;
  EXPECT_TRUE(same_bits(r.clip_to, v.clip_to)) << at;
  EXPECT_TRUE(same_bits(r.clip, clip)) << at;
  EXPECT_EQ(grad_scale, static_cast<float>(v.loss_scale / clip)) << at;
  // The host records the agreed step as the trainer does; the device did the same.
  const bool skip = v.decision == Decision::kSkip;
  detector.record(v);
  n.taken += skip ? 0 : 1;
  n.skipped += skip ? 1 : 0;
  n.clipped += v.decision == Decision::kClip ? 1 : 0;
  n.overflows += v.overflow ? 1 : 0;
  expect_same_state(dev, detector, world, at);
  return true;
}

}  // namespace

TEST(DecisionCore, TheDeviceDecisionIsTheHostDecisionBitForBit) {
  for (int world : {1, 2, 3, 4, 8})
    for (const Policy policy :
         {Policy{true, "none", OnGlobalSpike::kClip}, Policy{true, "dynamic", OnGlobalSpike::kClip},
          Policy{true, "none", OnGlobalSpike::kSkip}, Policy{true, "none", OnGlobalSpike::kAbort},
          Policy{false, "none", OnGlobalSpike::kClip},
          Policy{true, "none", OnGlobalSpike::kClip, AdaptiveClip::kZClip},
          Policy{true, "dynamic", OnGlobalSpike::kSkip, AdaptiveClip::kZClip},
          Policy{true, "none", OnGlobalSpike::kSkip, AdaptiveClip::kOff, 0.9}}) {
      SkipConfig cfg;
      cfg.enabled = policy.enabled;
      cfg.on_global_spike = policy.on_global_spike;
      cfg.adaptive_clip = policy.adaptive_clip;
      cfg.zclip_warmup = 10;
      cfg.window = 32;
      cfg.min_history = 8;
      cfg.max_grad_norm = 40;
      cfg.max_consecutive = policy.max_seconds > 0 ? 0 : 2;
      cfg.max_consecutive_seconds = policy.max_seconds;
      cfg.max_fraction = 0.1;
      cfg.fraction_window = 20;
      TrainingConfig training;
      training.loss_scale = policy.scaling;
      training.loss_scale_init = 1024;
      training.loss_scale_growth_interval = 7;
      training.loss_scale_min = 128;
      training.max_norm = 1.0;
      // The trainer's mapping of the config (the device decision uses the same).
      const core::DecideConfig config = decide_config(cfg, training);
      const std::string what = std::to_string(world) + " ranks, skip " +
                               (policy.enabled ? "on, " : "off, ") + policy.scaling + ", " +
                               std::string(name_of(policy.on_global_spike)) + ", " +
                               std::string(name_of(policy.adaptive_clip)) +
                               (policy.max_seconds > 0 ? ", seconds guard" : "");
      std::mt19937_64 rng(20261204 + std::hash<std::string>{}(what));  // each case its own
      std::mt19937_64 clock(world);  // compute times apart: the faults stay those of the seed
      Counts n;
      for (int run = 0; run < 40 && n.taken < 2000; ++run) {  // a fresh run after every abort
        SkipDetector detector(cfg, training, world);
        DeviceState dev(cfg.window, cfg.fraction_window, world, detector.loss_scale());
        for (int step = 1; step <= 400; ++step) {
          const std::string at = what + ", run " + std::to_string(run) + ", step " +
                                 std::to_string(step);
          auto table = test::random_step(rng, world, detector.loss_scale());
          if (policy.max_seconds > 0)  // each rank's compute time: the slowest one's counts
            for (RankStats& r : table) r.compute_seconds = 0.2 + 0.6 * (clock() % 1000) / 1000.0;
          if (!decide_both(table, detector, dev, training, config, n, at)) break;
          if (HasFailure()) FAIL() << "first difference: " << at;
        }
      }
      // Every path was taken: steps, skips, clips, aborts (and overflows with loss scaling).
      EXPECT_GT(n.taken, 300) << what;
      // One rank's spike is global: clipped, so only nonfinite steps are skipped and can abort.
      const bool all_global = world == 1 && policy.on_global_spike == OnGlobalSpike::kClip;
      EXPECT_GT(n.aborted, all_global ? 0 : 3) << what;
      if (policy.enabled) {
        EXPECT_GT(n.skipped, 20) << what;
      }
      if (policy.enabled && policy.on_global_spike == OnGlobalSpike::kClip && world > 1) {
        EXPECT_GT(n.clipped, 10) << what;
      }
      if (policy.adaptive_clip == AdaptiveClip::kZClip && world > 1) {
        EXPECT_GT(n.clipped, 10) << what << ": ZClip clips global spikes whatever on_global_spike";
      }
      if (policy.enabled && policy.on_global_spike == OnGlobalSpike::kAbort && world > 1) {
        EXPECT_GT(n.global_aborts, 3) << what;
      }
      if (policy.max_seconds > 0) {
        EXPECT_GT(n.seconds_aborts, 3) << what;
      }
      if (std::string(policy.scaling) == "dynamic") {
        EXPECT_GT(n.overflows, 5) << what;
      }
    }
}

TEST(Exchange, TheRowBuiltOnTheDeviceIsTheHostRowBitForBit) {
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> u(0, 10);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int i = 0; i < 200; ++i) {
    const int tensors = 1 + static_cast<int>(rng() % 4);
    const auto stats = [&] {  // a GradCheck stats buffer: nonfinite, sumsq, overflow runs, ...
      at::Tensor t = at::empty({kernels::kStatsHeader + 2 * tensors}, at::kDouble);
      for (int64_t k = 0; k < t.numel(); ++k) t.data_ptr<double>()[k] = u(rng);
      t.data_ptr<double>()[0] = static_cast<double>(rng() % 3);
      return t;
    };
    const at::Tensor local = i % 5 == 0 ? at::Tensor() : stats(), shard = stats();
    at::Tensor samples = at::empty({1 + static_cast<int64_t>(rng() % 8)}, at::kDouble);
    for (int64_t k = 0; k < samples.numel(); ++k)
      samples.data_ptr<double>()[k] = rng() % 7 == 0 ? nan : u(rng);
    const at::Tensor loss = at::full({}, i % 9 == 0 ? nan : u(rng), at::kDouble);
    const bool stop = i % 4 == 0;
    const at::Tensor row = rank_row(local, shard, loss, samples, stop);
    const std::vector<double> sl(samples.data_ptr<double>(),
                                 samples.data_ptr<double>() + samples.numel());
    const RankStats want =
        rank_stats(local.defined() ? GradCheck::read(local) : GradCheckStats{},
                   GradCheck::read(shard), loss.item<double>(), sl, stop);
    ASSERT_EQ(row.numel(), kRankStatsDoubles);
    ASSERT_EQ(std::memcmp(row.data_ptr<double>(), &want, sizeof want), 0) << "case " << i;
  }
}

// A GPU may give an arithmetic NaN other bits than the CPU: every NaN the core returns is the
// one canonical quiet NaN, whatever payload the table held.
TEST(DecisionCore, EveryNaNItReturnsIsTheCanonicalOne) {
  double odd;
  const uint64_t bits = 0xfff8000000000123ULL;  // negative, with a payload
  std::memcpy(&odd, &bits, sizeof odd);
  const double canonical = std::numeric_limits<double>::quiet_NaN();
  std::vector<RankStats> table = test::healthy(3, 1.0, 2.0);
  table[1].loss = odd;
  table[2].shard_nonfinite = 1;
  table[2].local_sumsq = odd;
  SkipDetector detector(test::enabled_policy(), TrainingConfig{}, 3);
  const Verdict v = detector.decide(table);
  EXPECT_TRUE(same_bits(v.loss, canonical));
  EXPECT_TRUE(same_bits(v.grad_norm, canonical));
  EXPECT_TRUE(same_bits(v.rank_loss[1], canonical));
  EXPECT_TRUE(same_bits(v.rank_grad_norm[2], canonical));
  EXPECT_EQ(v.decision, Decision::kSkip);
}
