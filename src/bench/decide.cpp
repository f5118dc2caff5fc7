// `lockstep bench decision`: what the step decision itself costs as the world grows, apart
// from the collective that brings the table (measured by `lockstep bench comm`): microseconds,
// the bytes each rank receives and the decision's memory per rank. Two forms of the one decision
// over the same tables: the host's SkipDetector (the core plus the names) and core::decide_step
// alone (the device's form, here compiled for the host); every outcome is compared.
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

// Tables drawn once and cycled (a world of 100,000 ranks is 7.2 MB a table).
constexpr size_t kTables = 16;

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
  for (size_t i = 0; i < kTables && static_cast<int>(i) < o.steps; ++i)
    tables.push_back(healthy_table(rng, world));
  Timing t;
  std::vector<Decision> host(static_cast<size_t>(o.steps));
  auto start = Clock::now();
  for (size_t i = 0; i < host.size(); ++i) {
    const Verdict v = detector.decide(tables[i % tables.size()]);
    detector.record(v);
    host[i] = v.decision;
  }
  t.host_us = std::chrono::duration<double, std::micro>(Clock::now() - start).count() / o.steps;
  std::vector<double> flat(static_cast<size_t>(world) * core::kStatsDoubles);
  start = Clock::now();
  for (size_t i = 0; i < host.size(); ++i) {
    std::memcpy(flat.data(), tables[i % tables.size()].data(), flat.size() * sizeof(double));
    core::DecideResult r{};
    float found_inf = 0, grad_scale = 0;
    core::decide_step(flat.data(), world, s, c, r, &found_inf, &grad_scale);
    t.agreed = t.agreed && (r.outcome == core::kTake) == (host[i] == Decision::kStep);
  }
  t.core_us = std::chrono::duration<double, std::micro>(Clock::now() - start).count() / o.steps;
  return t;
}

// "7.0 MiB", "72 B".
std::string bytes_text_short(double b) {
  if (b < 1024) return fmt::format("{:.0f} B", b);
  if (b < 1048576) return fmt::format("{:.1f} KiB", b / 1024);
  return fmt::format("{:.1f} MiB", b / 1048576);
}

}  // namespace

bool bench_decision(const DecisionBenchOptions& o) {
  const SkipConfig skip;
  fmt::print("lockstep bench decision | {} | {} steps per world size, windows of {}, one "
             "thread\n",
             describe_machine(false), o.steps, skip.window);
  fmt::print("bytes received: the stats table's all-gather, {} B from each other rank; memory: "
             "the decision's state (every rank's windows) and the table, the same on the host and "
             "on the device\n",
             sizeof(RankStats));
  fmt::print("{:>7} | {:>14} | {:>20} | {:>19} | {:>15} | {}\n", "ranks", "host decide us",
             "device form (host) us", "bytes received/step", "memory per rank", "same outcomes");
  bool ok = true;
  for (int world : o.worlds) {
    const Timing t = time_world(world, o);
    ok = ok && t.agreed;
    const double received = static_cast<double>(sizeof(RankStats)) * (world - 1);
    const double memory =
        8.0 * static_cast<double>(core::decide_state_doubles(skip.window, skip.fraction_window,
                                                             world)) +
        static_cast<double>(sizeof(RankStats)) * world;
    fmt::print("{:>7} | {:>14.2f} | {:>20.3f} | {:>19} | {:>15} | {}\n", world, t.host_us,
               t.core_us, bytes_text_short(received), bytes_text_short(memory),
               t.agreed ? "yes" : "NO");
  }
  return ok;
}

}  // namespace lockstep
