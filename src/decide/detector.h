// The step decision: STEP, SKIP, CLIP, SALVAGE or ABORT, from numbers every rank holds
// identically (the all-gathered per-rank stats, reduced in rank order) and from detector state
// that every rank advances identically: z-scores over rolling windows (the global values' and
// each rank's own), thresholds, the anomaly's scope (local: a minority of ranks stand out
// against their own windows; global: most do, or none does), its policy, guards, culprits.
// Plain C++: no tensors, so it is unit-tested directly. Its numbers (the rank-order reduction,
// window z-scores, thresholds, the scope's counts, the clip bound, guard counts) come from the
// framework-free core in kernels/decision.h, which the device runs too (decision.cu), so host
// and device agree bit for bit; culprit names and causes are computed here only.
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

// A reason's name (kernels/decision.h's bit `bit`: nonfinite_grad, ..., loss_spike).
const char* reason_name(int bit);

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

// Each rank's own values against its own windows, from the all-gathered table: which ranks
// stand out, and why. Every rank computes it from the same table and windows.
struct LocalFindings {
  std::vector<int> outliers;         // nonfinite own gradient or loss, or own z above threshold
  std::vector<std::string> reasons;  // what they showed (nonfinite_grad, grad_norm_spike, ...)
  bool sample_evidence = false;      // some outlier holds samples whose own loss is nonfinite
  std::vector<double> grad_norm_z, loss_z;  // per rank; NaN while its window is short
  // A minority of ranks (at most half), or samples that name themselves (kernels::is_local).
  bool local(size_t world) const;
};

// What was settled before the gradient sync (skip.scope = "rank", skip.replay): the local
// culprits, the ranks whose contribution was dropped, what replays found. Empty otherwise.
struct Triage {
  std::vector<int> culprits;
  std::vector<std::string> reasons;
  std::vector<int> dropped;
  std::vector<ReplayResult> replays;
  std::string cause;
  std::vector<int> hardware_suspects;
  bool skip_step = false;  // the culprits' gradients stay bad and cannot all be dropped
};

class SkipDetector {
 public:
  explicit SkipDetector(const SkipConfig& config);

  // The decision for one step from every rank's stats, in rank order, the gradients carrying
  // `scaler`'s loss scale, after `triage`. Pure: the same inputs and state give the same
  // verdict, bit for bit, on every rank. With loss scaling on, a nonfinite gradient with every
  // loss finite is an overflow: skipped with reason loss_scale_overflow whatever skip.enabled
  // says, outside the skip guards (the scaler has its own), blaming no rank.
  Verdict decide(const std::vector<RankStats>& ranks, const LossScaler& scaler,
                 const Triage& triage = {}) const;
  Verdict decide(const std::vector<RankStats>& ranks) const;  // no loss scaling
  // Each rank's own values against its windows (scope.cpp); `scale` = the loss scale.
  LocalFindings local_findings(const std::vector<RankStats>& ranks, double scale = 1) const;
  // Advances the state with a decided step. A skip's outlier never enters the windows; a
  // clip enters them bounded to the windows' limits; a salvage enters without the dropped
  // ranks' values; an abort and an overflow change nothing.
  void record(const Verdict& v);
  // skip.reset_guards_on_resume: the guards count from 0 again (the windows stay).
  void reset_guards();

  int64_t consecutive_skips() const { return consecutive_; }
  int64_t history() const { return grad_norms_.size(); }
  const std::deque<bool>& recent() const { return recent_; }  // true = skipped, oldest first
  const Window& grad_norms() const { return grad_norms_; }
  const Window& losses() const { return losses_; }
  const std::vector<Window>& rank_grad_norms() const { return rank_grad_norms_; }
  const std::vector<Window>& rank_losses() const { return rank_losses_; }

  // The whole state, for checkpoints; doubles round-trip exactly through JSON.
  nlohmann::json state() const;
  void load_state(const nlohmann::json& state);

 private:
  // The guard a skip now would trip (it becomes an abort), or "".
  std::string guard_tripped() const;
  // scope.cpp: scope, culprits and cause of an anomalous step, then the policy's decision.
  void attribute(Verdict& v, const std::vector<RankStats>& ranks, const LocalFindings& f,
                 const Triage& triage) const;
  void apply_policy(Verdict& v) const;
  // The largest value `w` accepts (mean + z * std) once it holds min_history values, else v.
  double bounded(const Window& w, double v, double z) const;

  SkipConfig cfg_;
  Window grad_norms_, losses_;
  std::vector<Window> rank_grad_norms_, rank_losses_;  // each rank's own, in rank order
  int64_t consecutive_ = 0;
  std::deque<bool> recent_;  // the last fraction_window decisions, true = skipped
  int64_t recent_skips_ = 0;
};

}  // namespace lockstep
