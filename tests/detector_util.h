// Helpers of the tests that drive the SkipDetector directly with hand-made per-rank stats.
#pragma once

#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <vector>

#include "decide/detector.h"

namespace lockstep::test {

// Skipping on, a short window, no guards.
inline SkipConfig enabled_policy() {
  SkipConfig c;
  c.enabled = true;
  c.window = 16;
  c.min_history = 8;
  c.max_consecutive = 0;
  c.max_fraction = 0;
  return c;
}

// `w` healthy ranks, each with own gradient norm `norm` and loss `loss`, whose synced shards add
// up to a global norm of `norm` and loss `loss`.
inline std::vector<RankStats> healthy(int w, double norm, double loss) {
  std::vector<RankStats> v(static_cast<size_t>(w));
  for (auto& r : v) {
    r.shard_sumsq = norm * norm / w;
    r.local_sumsq = norm * norm;
    r.loss = loss;
  }
  return v;
}

// Feeds `n` accepted steps of `world` ranks with a little deterministic jitter (every rank's own
// windows fill too).
inline void warm_up(SkipDetector& d, int n, double norm = 1.0, double loss = 3.0, int world = 2) {
  for (int i = 0; i < n; ++i) {
    const double j = 0.01 * ((i * 7) % 5);
    Verdict v = d.decide(healthy(world, norm + j, loss - j));
    ASSERT_EQ(v.decision, Decision::kStep) << "warm-up step " << i;
    d.record(v);
  }
}

// One step's table, the gradient carrying loss scale `scale`: every rank healthy with jitter,
// and now and then a fault on one rank (a nonfinite gradient element, a nonfinite loss, a
// gradient spike in the synced shard alone or in its own norm too, a loss spike) or a gradient
// spike on every rank.
inline std::vector<RankStats> random_step(std::mt19937_64& rng, int world, double scale) {
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<RankStats> t(static_cast<size_t>(world));
  for (auto& r : t) {
    const double norm = (1.0 + 0.2 * u(rng)) * scale;
    r.shard_sumsq = norm * norm / world;
    r.local_sumsq = norm * norm;
    r.loss = 3.0 + 0.3 * u(rng);
  }
  const double p = u(rng);
  RankStats& bad = t[static_cast<size_t>(rng() % world)];
  if (p < 0.03) bad.shard_nonfinite = 1 + static_cast<double>(rng() % 3);
  else if (p < 0.05) bad.loss = std::numeric_limits<double>::quiet_NaN();
  else if (p < 0.09) bad.shard_sumsq *= 2500;
  else if (p < 0.12) bad.loss *= 4;
  else if (p < 0.14) bad.local_sumsq *= 2500, bad.shard_sumsq *= 2500;  // its own norm too
  else if (p < 0.17)  // on every rank: the model, not a batch
    for (auto& r : t) r.shard_sumsq *= 100, r.local_sumsq *= 100;
  return t;
}

}  // namespace lockstep::test
