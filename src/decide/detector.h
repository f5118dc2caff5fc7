// The step decision: STEP, SKIP or ABORT, from numbers every rank holds identically (the
// all-gathered per-rank stats, reduced in rank order) and from detector state that every rank
// advances identically: z-scores over rolling windows, thresholds, guards, culprit ranks.
// Plain C++: no tensors, so it is the same code on every device and is unit-tested directly.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "decide/loss_scale.h"
#include "lockstep/config.h"
#include "lockstep/decision.h"

namespace lockstep {

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

  // The decision for one step from every rank's stats, in rank order, the gradients carrying
  // `scaler`'s loss scale. Pure: the same inputs and state give the same verdict, bit for bit,
  // on every rank. With loss scaling on, a nonfinite gradient with every loss finite is an
  // overflow: skipped with reason loss_scale_overflow whatever skip.enabled says, outside the
  // skip guards (the scaler has its own), blaming no rank.
  Verdict decide(const std::vector<RankStats>& ranks, const LossScaler& scaler) const;
  Verdict decide(const std::vector<RankStats>& ranks) const;  // no loss scaling
  // Advances the state with a decided step (the outlier of a skip never enters the windows;
  // an abort and an overflow change nothing).
  void record(const Verdict& v);

  int64_t consecutive_skips() const { return consecutive_; }
  int64_t history() const { return grad_norms_.size(); }
  const Window& grad_norms() const { return grad_norms_; }
  const Window& losses() const { return losses_; }

  // The whole state, for checkpoints; doubles round-trip exactly through JSON.
  nlohmann::json state() const;
  void load_state(const nlohmann::json& state);

 private:
  // The guard a skip now would trip (it becomes an abort), or "".
  std::string guard_tripped() const;

  SkipConfig cfg_;
  Window grad_norms_, losses_;
  int64_t consecutive_ = 0;
  std::deque<bool> recent_;  // the last fraction_window decisions, true = skipped
  int64_t recent_skips_ = 0;
};

}  // namespace lockstep
