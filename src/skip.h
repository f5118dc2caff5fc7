// The step decision: STEP, SKIP or ABORT, from numbers every rank holds identically (the
// all-gathered per-rank stats, reduced in rank order) and from detector state that every rank
// advances identically. Plain C++: no tensors, so it is the same code on every device and is
// unit-tested directly.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lockstep/config.h"

namespace lockstep {

// What one rank contributes to a step's decision: 8 doubles, 64 bytes, all-gathered once per
// step. Counts are integers held exactly in fp64 (up to 2^53).
struct RankStats {
  double shard_nonfinite = 0;  // [B] nonfinite elements in the synced shard this rank checks
  double shard_sumsq = 0;      // [B] sum of squares of that shard
  double local_nonfinite = 0;  // [A] nonfinite elements in this rank's own gradient, pre-sync
  double local_sumsq = 0;      // [A] its sum of squares (0 when diagnostics.local_check is off)
  double loss = 0;             // this rank's loss (mean over its tokens; all ranks hold as many)
  double stop_requested = 0;   // 1: this rank got SIGTERM or SIGINT and asks all to stop
  double overflow_runs = 0;    // [B] runs whose fp32 sum of squares overflowed (summed in fp64)
  double bad_samples = 0;      // samples of this rank's batch whose loss is nonfinite
};
static_assert(sizeof(RankStats) == 64, "one step's stats are 64 bytes per rank");
constexpr int kRankStatsDoubles = 8;

enum class Decision { kStep, kSkip, kAbort };
const char* decision_name(Decision d);  // "step", "skip", "abort"

struct Verdict {
  Decision decision = Decision::kStep;
  std::vector<std::string> reasons;  // nonfinite_grad, nonfinite_loss, grad_norm_above_max,
                                     // grad_norm_spike, loss_spike
  std::string guard;                 // set when a guard turned a skip into an abort
  double grad_norm = 0;              // global, before clipping
  double nonfinite = 0;              // global nonfinite gradient elements
  double loss = 0;                   // global (mean over ranks)
  bool stop = false;                 // some rank asks to stop after this step (a signal)
  double overflow_runs = 0;
  double grad_norm_z = 0, loss_z = 0;  // NaN while the window is too short or the test is off
  std::vector<int> culprit_ranks;      // ranks whose own data caused it, as far as knowable
  bool anomalous() const { return decision != Decision::kStep; }
};

// Rolling window of accepted values: mean and population std, summed oldest first.
class Window {
 public:
  explicit Window(int64_t capacity = 128) : capacity_(capacity) {}
  void push(double v);
  int64_t size() const { return static_cast<int64_t>(values_.size()); }
  double mean() const;
  double stddev() const;
  // (v - mean) / std, with std floored at 1e-12 * |mean| so a flat window is not a hair trigger.
  double zscore(double v) const;
  const std::deque<double>& values() const { return values_; }
  void assign(const std::vector<double>& values);

 private:
  int64_t capacity_;
  std::deque<double> values_;
};

class SkipDetector {
 public:
  explicit SkipDetector(const SkipConfig& config);

  // The decision for one step from every rank's stats, in rank order. Pure: the same inputs
  // and state give the same verdict, bit for bit, on every rank.
  Verdict decide(const std::vector<RankStats>& ranks) const;
  // Advances the state with a decided step (the outlier of a skip never enters the windows;
  // an abort changes nothing).
  void record(const Verdict& v);

  int64_t consecutive_skips() const { return consecutive_; }
  int64_t history() const { return grad_norms_.size(); }
  const Window& grad_norms() const { return grad_norms_; }
  const Window& losses() const { return losses_; }

  // The whole state, for checkpoints; doubles round-trip exactly through JSON.
  nlohmann::json state() const;
  void load_state(const nlohmann::json& state);

 private:
  SkipConfig cfg_;
  Window grad_norms_, losses_;
  int64_t consecutive_ = 0;
  std::deque<bool> recent_;  // the last fraction_window decisions, true = skipped
  int64_t recent_skips_ = 0;
};

}  // namespace lockstep
