// The decision's shared core (kernels/decision.h): decide_step, the form the device runs, takes
// the host's decisions bit for bit over long random runs with faults, guards and fp16 loss
// scaling (SkipDetector with skip.on_global_spike = "skip", LossScaler, the trainer's
// counters), and an abort is sticky. And the exchanged row built where the tensors live is the
// host's.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <vector>

#include "decide/detector.h"
#include "decide/device_decision.h"
#include "decide/exchange.h"
#include "decide/loss_scale.h"
#include "detector_util.h"
#include "kernels/decision.h"
#include "optim/adamw.h"

using namespace lockstep;

namespace {

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// A device-style state: its rings in a host vector.
struct DeviceState {
  std::vector<double> rings;
  kernels::DecideState s;
  DeviceState(int64_t window, int64_t fraction_window, double scale)
      : rings(kernels::decide_state_doubles(window, fraction_window)),
        s(kernels::fresh_decide_state(rings.data(), window, fraction_window, scale)) {}
  static std::vector<double> values(const kernels::Ring& r) {
    std::vector<double> out;
    for (int64_t i = 0; i < r.size; ++i) out.push_back(kernels::ring_at(r, i));
    return out;
  }
};

// The host guard's name for the core's `why`.
std::string guard_prefix(int32_t why) {
  switch (why) {
    case kernels::kMaxConsecutive: return "skip.max_consecutive";
    case kernels::kMaxFraction: return "skip.max_fraction";
    case 10 + kernels::kMaxOverflows: return "training.loss_scale_max_overflows";
    case 10 + kernels::kScaleMin: return "training.loss_scale_min";
    case kernels::kSkipDisabled: return "skip.enabled = false";
    default: return "";
  }
}

struct Policy {
  bool enabled;
  const char* scaling;
};

}  // namespace

TEST(DecisionCore, TheDeviceDecisionIsTheHostDecisionBitForBit) {
  std::mt19937_64 rng(20261204);
  for (int world : {1, 2, 3, 4, 8})
    for (const Policy policy :
         {Policy{true, "none"}, Policy{true, "dynamic"}, Policy{false, "none"}}) {
      SkipConfig cfg;
      cfg.enabled = policy.enabled;
      cfg.on_global_spike = OnGlobalSpike::kSkip;
      cfg.window = 32;
      cfg.min_history = 8;
      cfg.max_grad_norm = 40;
      cfg.max_consecutive = 2;
      cfg.max_fraction = 0.1;
      cfg.fraction_window = 20;
      TrainingConfig training;
      training.loss_scale = policy.scaling;
      training.loss_scale_init = 1024;
      training.loss_scale_growth_interval = 7;
      training.loss_scale_min = 128;
      training.max_norm = 1.0;
      const double max_norm = training.max_norm;
      const bool dynamic = std::string(policy.scaling) == "dynamic";
      // The trainer's mapping of the config (the device decision uses the same).
      const kernels::DecideConfig config = decide_config(cfg, training);
      int taken = 0, skipped = 0, aborted = 0, overflows = 0;
      for (int run = 0; run < 40 && taken < 2000; ++run) {  // a fresh run after every abort
        SkipDetector detector(cfg);
        LossScaler scaler(training);
        DeviceState dev(cfg.window, cfg.fraction_window, scaler.scale());
        int64_t optimizer_steps = 0, skipped_steps = 0, overflow_skips = 0;
        for (int step = 1; step <= 400; ++step) {
          const std::string at = std::to_string(world) + " ranks, skip " +
                                 (policy.enabled ? "on, " : "off, ") + policy.scaling + ", run " +
                                 std::to_string(run) + ", step " + std::to_string(step);
          const std::vector<RankStats> table = test::random_step(rng, world, scaler.scale());
          const Verdict v = detector.decide(table, scaler);
          std::vector<double> flat(table.size() * kernels::kStatsDoubles);
          std::memcpy(flat.data(), table.data(), flat.size() * sizeof(double));
          kernels::DecideResult r{};
          float found_inf = -1, grad_scale = -1;
          kernels::decide_step(flat.data(), world, dev.s, config, r, &found_inf, &grad_scale);

          ASSERT_TRUE(same_bits(r.grad_norm, v.grad_norm)) << at;
          ASSERT_TRUE(same_bits(r.loss, v.loss)) << at;
          ASSERT_TRUE(same_bits(r.grad_norm_z, v.grad_norm_z)) << at;
          ASSERT_TRUE(same_bits(r.loss_z, v.loss_z)) << at;
          ASSERT_TRUE(same_bits(r.loss_scale, v.loss_scale)) << at;
          ASSERT_EQ(r.overflow != 0, v.overflow) << at;
          const Decision want = r.outcome == kernels::kTake       ? Decision::kStep
                                : r.outcome == kernels::kSkipStep ? Decision::kSkip
                                                                  : Decision::kAbort;
          ASSERT_EQ(decision_name(want), std::string(decision_name(v.decision))) << at;
          ASSERT_EQ(found_inf, v.decision == Decision::kStep ? 0.0f : 1.0f) << at;
          if (v.decision == Decision::kAbort) {
            ASSERT_FALSE(guard_prefix(r.why).empty()) << at << ": why " << r.why;
            ASSERT_EQ(v.guard.rfind(guard_prefix(r.why), 0), 0u) << at << ": " << v.guard;
            // Sticky: whatever comes next, nothing is updated.
            kernels::decide_step(flat.data(), world, dev.s, config, r, &found_inf, &grad_scale);
            ASSERT_EQ(r.outcome, kernels::kAbortRun) << at;
            ASSERT_EQ(r.why, kernels::kStickyAbort) << at;
            ASSERT_EQ(found_inf, 1.0f) << at;
            ++aborted;
            break;
          }
          const double clip =
              v.decision == Decision::kStep ? clip_coefficient(v.grad_norm, max_norm) : 1.0;
          ASSERT_TRUE(same_bits(r.clip, clip)) << at;
          ASSERT_EQ(grad_scale, static_cast<float>(v.loss_scale / clip)) << at;
          // The host records the agreed step as the trainer does; the device did the same.
          const bool skip = v.decision == Decision::kSkip;
          detector.record(v);
          scaler.record(v.overflow, !skip);
          optimizer_steps += skip ? 0 : 1;
          skipped_steps += skip && !v.overflow ? 1 : 0;
          overflow_skips += v.overflow ? 1 : 0;
          taken += skip ? 0 : 1;
          skipped += skip ? 1 : 0;
          overflows += v.overflow ? 1 : 0;
          const auto& w = detector.grad_norms().values();
          ASSERT_EQ(DeviceState::values(dev.s.grad_norms), std::vector<double>(w.begin(), w.end()))
              << at;
          const auto& l = detector.losses().values();
          ASSERT_EQ(DeviceState::values(dev.s.losses), std::vector<double>(l.begin(), l.end()))
              << at;
          ASSERT_TRUE(same_bits(dev.s.scale.scale, scaler.scale())) << at;
          ASSERT_EQ(dev.s.scale.consecutive_overflows, scaler.consecutive_overflows()) << at;
          ASSERT_EQ(dev.s.consecutive_skips, detector.consecutive_skips()) << at;
          ASSERT_EQ(dev.s.optimizer_steps, optimizer_steps) << at;
          ASSERT_EQ(dev.s.skipped_steps, skipped_steps) << at;
          ASSERT_EQ(dev.s.overflow_skips, overflow_skips) << at;
        }
      }
      // Every path was taken: steps, skips, aborts (and overflows with loss scaling).
      const std::string what = std::to_string(world) + " ranks, " + policy.scaling;
      EXPECT_GT(taken, 300) << what;
      EXPECT_GT(aborted, 3) << what;
      if (policy.enabled) {
        EXPECT_GT(skipped, 20) << what;
      }
      if (dynamic) {
        EXPECT_GT(overflows, 5) << what;
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
