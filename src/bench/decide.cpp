// `lockstep bench decision`: what the step decision itself costs as the world grows, apart
// from the collective that brings the table (measured by `lockstep bench comm`). Two forms of
// the one decision over the same tables: the host's SkipDetector (the core plus the names: scope
// and culprits) and core::decide_step alone (the device's form, here compiled for
// the host). Every timed call's outcome is compared between the two.
#include <fmt/core.h>

#include <chrono>
#include <cstring>
#include <random>

#include "bench/machine.h"
#include "decide/detector.h"
#include "decide/device_decision.h"
#include "decide/core/step.h"
#include "decide/core/tensors.h"
#include "lockstep/bench.h"

namespace lockstep {
namespace {

using Clock = std::chrono::steady_clock;

// Healthy tables with jitter: every step is taken, so the windows keep moving.
std::vector<RankStats> healthy_table(std::mt19937_64& rng, int world) {
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<RankStats> t(static_cast<size_t>(world));
  for (auto& r : t) {
    const double norm = 1.0 + 0.1 * u(rng);
    r.shard_sumsq = norm * norm / world;
    r.local_sumsq = norm * norm;
    r.loss = 3.0 + 0.1 * u(rng);
  }
  return t;
}

struct Timing {
  double host_us = 0, core_us = 0;
  bool agreed = true;
};

Timing time_world(int world, const DecisionBenchOptions& o) {
  SkipConfig cfg;
  cfg.enabled = true;  // and the default policy: a global spike is clipped
  SkipDetector detector(cfg, TrainingConfig{}, world);
  std::vector<double> rings(core::decide_state_doubles(cfg.window, cfg.fraction_window, world));
  core::DecideState s =
      core::fresh_decide_state(rings.data(), cfg.window, cfg.fraction_window, world, 1.0);
  const core::DecideConfig c = decide_config(cfg, TrainingConfig{});
  std::mt19937_64 rng(1);
  std::vector<std::vector<RankStats>> tables;
  for (int i = 0; i < o.steps; ++i) tables.push_back(healthy_table(rng, world));
  Timing t;
  std::vector<Decision> host(tables.size());
  auto start = Clock::now();
  for (size_t i = 0; i < tables.size(); ++i) {
    const Verdict v = detector.decide(tables[i]);
    detector.record(v);
    host[i] = v.decision;
  }
  t.host_us = std::chrono::duration<double, std::micro>(Clock::now() - start).count() / o.steps;
  std::vector<double> flat(static_cast<size_t>(world) * core::kStatsDoubles);
  start = Clock::now();
  for (size_t i = 0; i < tables.size(); ++i) {
    std::memcpy(flat.data(), tables[i].data(), flat.size() * sizeof(double));
    core::DecideResult r{};
    float found_inf = 0, grad_scale = 0;
    core::decide_step(flat.data(), world, s, c, r, &found_inf, &grad_scale);
    t.agreed = t.agreed && (r.outcome == core::kTake) == (host[i] == Decision::kStep);
  }
  t.core_us = std::chrono::duration<double, std::micro>(Clock::now() - start).count() / o.steps;
  return t;
}

}  // namespace

bool bench_decision(const DecisionBenchOptions& o) {
  fmt::print("lockstep bench decision | {} | {} steps per world size, windows of {}, one "
             "thread\n",
             describe_machine(false), o.steps, SkipConfig{}.window);
  fmt::print("{:>6} | {:>14} | {:>20} | {}\n", "ranks", "host decide us", "device form (host) us",
             "same outcomes");
  bool ok = true;
  for (int world : o.worlds) {
    const Timing t = time_world(world, o);
    ok = ok && t.agreed;
    fmt::print("{:>6} | {:>14.2f} | {:>20.3f} | {}\n", world, t.host_us, t.core_us,
               t.agreed ? "yes" : "NO");
  }
  return ok;
}

}  // namespace lockstep
