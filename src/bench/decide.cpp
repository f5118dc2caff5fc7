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
#include "decide/record.h"
#include "decide/device_decision.h"
#include "decide/core/record.h"
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
  double host_us = 0, core_us = 0, record_us = 0;
  bool agreed = true;
};

// The record every rank holds after the all-reduces of step `table` (the other ranks' findings
// from the table form's windows, which hold theirs): built outside the timing, as the
// collective's work, not the decision's.
core::StepRecord combined_record(const std::vector<RankStats>& table,
                                 const SkipDetector& detector) {
  const LocalFindings f = detector.local_findings(table);
  core::StepRecord all{};
  for (size_t r = 0; r < table.size(); ++r) {
    core::StepRecord mine{};
    core::record_contribution(rows_of(table) + r * core::kStatsDoubles, false, f.ranks[r], mine);
    if (r == 0) all = mine;
    else core::record_combine(all, mine);
  }
  return all;
}

// The cross-rank count every rank holds after its all-reduce (the device always counts it).
int64_t combined_below(const std::vector<RankStats>& table, const core::StepRecord& all) {
  int64_t below = 0;
  for (size_t r = 0; r < table.size(); ++r)
    below += core::record_below(rows_of(table) + r * core::kStatsDoubles, all);
  return below;
}

// Rank 0's own work per step in the record form, as the device's three kernels do it (the same
// core functions the host's form calls): its contribution from its own windows, its part of the
// count, the decision from the combined record and count, its windows. Outcomes against `host`.
double time_record(int world, const std::vector<std::vector<RankStats>>& tables,
                   const std::vector<core::StepRecord>& records,
                   const std::vector<int64_t>& belows, const std::vector<Decision>& host,
                   const core::DecideConfig& c, const SkipConfig& cfg, bool& agreed) {
  std::vector<double> rings(core::decide_state_doubles(cfg.window, cfg.fraction_window, 1));
  core::DecideState own =
      core::fresh_decide_state(rings.data(), cfg.window, cfg.fraction_window, 1, 1.0);
  const auto start = Clock::now();
  for (size_t i = 0; i < host.size(); ++i) {
    const double* row = rows_of(tables[i % tables.size()]);
    core::StepRecord mine{};
    core::record_contribute(row, own, c, mine);
    const int64_t below = core::record_below(row, records[i]);  // its part; belows[i]: all
    core::DecideResult r{};
    float found_inf = 0, grad_scale = 0;
    core::decide_record_step(records[i], world, belows[i], row, own, c, r, &found_inf,
                             &grad_scale);
    agreed = agreed && (r.outcome == core::kTake) == (host[i] == Decision::kStep) &&
             mine.maxes.local_sumsq != 0 && below <= belows[i];
  }
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count() /
         static_cast<double>(host.size());
}

// Tables drawn once and cycled (a world of 100,000 ranks is 7.2 MB a table); the record form
// is timed over the first steps' records (each costs a pass over every rank's windows to build).
constexpr size_t kTables = 16;
constexpr size_t kRecords = 200;

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
  std::vector<core::StepRecord> records;  // the record form's input, step by step
  std::vector<int64_t> belows;
  double host_s = 0;
  for (size_t i = 0; i < host.size(); ++i) {
    if (i < kRecords) {
      records.push_back(combined_record(tables[i % tables.size()], detector));
      belows.push_back(combined_below(tables[i % tables.size()], records.back()));
    }
    const auto start = Clock::now();
    const Verdict v = detector.decide(tables[i % tables.size()]);
    detector.record(v);
    host_s += std::chrono::duration<double>(Clock::now() - start).count();
    host[i] = v.decision;
  }
  t.host_us = 1e6 * host_s / o.steps;
  const std::vector<Decision> first(host.begin(), host.begin() + records.size());
  t.record_us = time_record(world, tables, records, belows, first, c, cfg, t.agreed);
  std::vector<double> flat(static_cast<size_t>(world) * core::kStatsDoubles);
  const auto start = Clock::now();
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
  fmt::print("table form: every rank all-gathers the {} B rows and keeps every rank's windows "
             "(host: SkipDetector, device: core::decide_step compiled for the host); record form: "
             "each rank keeps its own windows and all-reduces one {} B record and one count "
             "(core/record.h; rank 0's own work per step as the device's kernels and the host "
             "run it, the all-reduces apart); bytes: received (table) or "
             "sent and received (record) per rank per step; memory: the decision's state and what "
             "is exchanged\n",
             sizeof(RankStats), RecordDecider::kExchangedBytes);
  fmt::print("{:>7} | {:>10} | {:>10} | {:>10} | {:>11} | {:>12} | {:>10} | {:>13} | {}\n",
             "ranks", "table host", "table dev", "record us", "table bytes", "record bytes",
             "table mem", "record mem", "same outcomes");
  bool ok = true;
  const RecordDecider one(decide_config(skip, TrainingConfig{}), skip.window, skip.fraction_window,
                          1.0);
  for (int world : o.worlds) {
    const Timing t = time_world(world, o);
    ok = ok && t.agreed;
    const double received = static_cast<double>(sizeof(RankStats)) * (world - 1);
    const double memory =
        8.0 * static_cast<double>(core::decide_state_doubles(skip.window, skip.fraction_window,
                                                             world)) +
        static_cast<double>(sizeof(RankStats)) * world;
    const double record = static_cast<double>(RecordDecider::kExchangedBytes);
    fmt::print("{:>7} | {:>10.2f} | {:>10.3f} | {:>10.3f} | {:>11} | {:>12} | {:>10} | {:>13} | "
               "{}\n",
               world, t.host_us, t.core_us, t.record_us, bytes_text_short(received),
               bytes_text_short(world > 1 ? record : 0), bytes_text_short(memory),
               bytes_text_short(static_cast<double>(one.state_bytes()) + record),
               t.agreed ? "yes" : "NO");
  }
  return ok;
}

}  // namespace lockstep
