// The decision's shared core (kernels/decision.h): screen_step, the form the device runs, gives
// the host SkipDetector's numbers bit for bit over long random runs with faults, and takes
// exactly the steps the host takes as clean, advancing the windows, the loss scale and the
// counters as the host does.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "decide/detector.h"
#include "decide/loss_scale.h"
#include "kernels/decision.h"
#include "detector_util.h"
#include "optim/adamw.h"

using namespace lockstep;

namespace {

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// A device-style state whose rings are loaded from the host detector's windows.
struct Mirror {
  std::vector<double> grad_norms, losses;
  kernels::ScreenState s{};
  explicit Mirror(int64_t capacity) : grad_norms(capacity), losses(capacity) {}
  void load(const SkipDetector& d, const LossScaler& scaler, int64_t optimizer_steps) {
    const auto fill = [](std::vector<double>& ring, const Window& w) {
      std::copy(w.values().begin(), w.values().end(), ring.begin());
      return kernels::Ring{ring.data(), static_cast<int64_t>(ring.size()), 0, w.size()};
    };
    s.grad_norms = fill(grad_norms, d.grad_norms());
    s.losses = fill(losses, d.losses());
    const auto st = scaler.state();
    s.scale = {scaler.scale(), st.at("growth_tracker").get<int64_t>(),
               st.at("consecutive_overflows").get<int64_t>()};
    s.consecutive_skips = d.consecutive_skips();
    s.optimizer_steps = optimizer_steps;
  }
  std::vector<double> values(const kernels::Ring& r) const {
    std::vector<double> out;
    for (int64_t i = 0; i < r.size; ++i) out.push_back(kernels::ring_at(r, i));
    return out;
  }
};

}  // namespace

TEST(DecisionCore, TheDeviceScreenIsTheHostDecisionBitForBit) {
  std::mt19937_64 rng(20261204);
  for (int world : {1, 2, 3, 4, 8})
    for (const char* scaling : {"none", "dynamic"}) {
      SkipConfig cfg;
      cfg.enabled = true;
      cfg.window = 32;
      cfg.min_history = 8;
      cfg.max_grad_norm = 40;
      cfg.max_consecutive = 0;
      cfg.max_fraction = 0;
      TrainingConfig training;
      training.loss_scale = scaling;
      training.loss_scale_init = 1024;
      training.loss_scale_growth_interval = 7;
      const double max_norm = 1.0;
      SkipDetector detector(cfg);
      LossScaler scaler(training);
      Mirror mirror(cfg.window);
      int64_t optimizer_steps = 0, held = 0, taken = 0;
      mirror.load(detector, scaler, optimizer_steps);
      const kernels::ScreenConfig config{
          {cfg.enabled, cfg.max_grad_norm, cfg.grad_norm_zscore, cfg.loss_zscore},
          cfg.min_history,
          max_norm,
          {scaler.enabled(), std::string(scaling) == "dynamic", training.loss_scale_growth_factor,
           training.loss_scale_backoff_factor, training.loss_scale_growth_interval}};
      for (int step = 1; step <= 600; ++step) {
        const std::string at = std::to_string(world) + " ranks, " + scaling + ", step " +
                               std::to_string(step);
        const std::vector<RankStats> table = test::random_step(rng, world, scaler.scale());
        const Verdict v = detector.decide(table, scaler);
        std::vector<double> flat(table.size() * kernels::kStatsDoubles);
        std::memcpy(flat.data(), table.data(), flat.size() * sizeof(double));
        kernels::ScreenResult r{};
        float found_inf = -1, grad_scale = -1;
        kernels::screen_step(flat.data(), world, mirror.s, config, r, &found_inf, &grad_scale);

        ASSERT_TRUE(same_bits(r.grad_norm, v.grad_norm)) << at;
        ASSERT_TRUE(same_bits(r.loss, v.loss)) << at;
        ASSERT_TRUE(same_bits(r.grad_norm_z, v.grad_norm_z)) << at;
        ASSERT_TRUE(same_bits(r.loss_z, v.loss_z)) << at;
        ASSERT_TRUE(same_bits(r.loss_scale, v.loss_scale)) << at;
        ASSERT_EQ(r.overflow != 0, v.overflow) << at;
        const bool clean = r.reasons == 0;
        ASSERT_EQ(clean, v.reasons.empty()) << at;
        ASSERT_EQ(clean, v.decision == Decision::kStep) << at << ": " << decision_name(v.decision);
        ASSERT_EQ(found_inf, clean ? 0.0f : 1.0f) << at;
        if (clean) {
          const double clip = clip_coefficient(v.grad_norm, max_norm);
          ASSERT_TRUE(same_bits(r.clip, clip)) << at;
          ASSERT_EQ(grad_scale, static_cast<float>(v.loss_scale / clip)) << at;
        }
        // The host decides and records the agreed step; the device's clean step must have
        // advanced its state the same way, and a held step gets the host's state back.
        detector.record(v);
        scaler.record(v.overflow, v.decision != Decision::kSkip && v.decision != Decision::kAbort);
        optimizer_steps += v.decision == Decision::kSkip || v.decision == Decision::kAbort ? 0 : 1;
        if (clean) {
          ++taken;
          ASSERT_EQ(mirror.values(mirror.s.grad_norms),
                    std::vector<double>(detector.grad_norms().values().begin(),
                                        detector.grad_norms().values().end()))
              << at;
          ASSERT_EQ(mirror.values(mirror.s.losses),
                    std::vector<double>(detector.losses().values().begin(),
                                        detector.losses().values().end()))
              << at;
          ASSERT_TRUE(same_bits(mirror.s.scale.scale, scaler.scale())) << at;
          ASSERT_EQ(mirror.s.optimizer_steps, optimizer_steps) << at;
          ASSERT_EQ(mirror.s.consecutive_skips, detector.consecutive_skips()) << at;
        } else {
          ++held;
          mirror.load(detector, scaler, optimizer_steps);
        }
      }
      // Both kinds of step happened, and the ring wrapped around (600 steps, window 32).
      EXPECT_GT(held, 20) << world << " ranks, " << scaling;
      EXPECT_GT(taken, 400) << world << " ranks, " << scaling;
    }
}
