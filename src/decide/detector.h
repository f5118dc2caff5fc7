// The step decision on the host: the core (decide/core/, which the device runs too) over state
// whose rings live in host memory, plus what only the host adds: the culprits, each rank's
// findings, the guards' messages. Plain C++: no tensors, unit-tested directly.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "decide/core/step.h"
#include "decide/verdict.h"
#include "lockstep/config.h"

namespace lockstep {

// The shared core's config from the run's: thresholds, guards, scope policy, the clip
// (training.max_norm) and the loss-scale rule and guards. The one reader of these settings.
core::DecideConfig decide_config(const SkipConfig& skip, const TrainingConfig& training);

// skip.max_consecutive_tokens as steps of `tokens_per_step` tokens (every step holds as many):
// skip.max_consecutive becomes the tighter of the two (max_consecutive_tokens stays set only
// when it is the one acting, so the guard's message names it). Throws ConfigError when the
// tokens are fewer than one step's.
SkipConfig with_token_guard(SkipConfig skip, int64_t tokens_per_step);

// Each rank's own values against its own windows, from the all-gathered table: the same on
// every rank.
struct LocalFindings {
  std::vector<core::RankFinding> ranks;  // in rank order
  std::vector<int> outliers;             // the ranks with reasons of their own
  uint32_t reasons = 0;                  // what they showed
  bool sample_evidence = false;          // some outlier holds samples whose loss is nonfinite
  bool local(size_t world) const;        // core::is_local
  void add(const core::RankFinding& k);  // the next rank's
};

// What was settled before the gradient sync (skip.scope = "rank", skip.replay): the local
// culprits, the ranks whose contribution was dropped, what replays found. Empty otherwise.
struct Triage {
  std::vector<int> culprits;
  uint32_t reasons = 0;  // core::Reason bits
  std::vector<int> dropped;
  std::vector<ReplayResult> replays;
  std::string cause;
  std::vector<int> hardware_suspects;
  bool skip_step = false;  // the culprits' gradients stay bad and cannot all be dropped
};

// The core's state (core::DecideState) over rings in host memory, for `world` ranks. A copy
// points at its own rings.
struct HostDecideState {
  HostDecideState(int64_t window, int64_t fraction_window, int world, double scale);
  HostDecideState(const HostDecideState& other);
  HostDecideState& operator=(const HostDecideState& other);
  // The same global windows, guards and loss scale for `world` ranks whose own windows are
  // empty (a fresh start, or a resume at another world size).
  HostDecideState resized(int world) const;

  std::vector<double> rings;
  core::DecideState s;
  int world;
};

// The global windows as the progress line and events report them.
struct WindowSummary {
  int64_t history = 0;
  double grad_norm_mean = 0, grad_norm_std = 0, loss_mean = 0, loss_std = 0;
};

class SkipDetector {
 public:
  // `world`: the ranks whose windows to hold (a table of another size starts them empty).
  // `own_rank` >= 0: the record form (skip.exchange, decide/record.h): the state holds that
  // rank's own windows only, and decide_own / name / record take the place of decide.
  explicit SkipDetector(const SkipConfig& skip, const TrainingConfig& training = {},
                        int world = 0, int own_rank = -1);

  // The decision for one step from every rank's stats, in rank order, after `triage`. Pure:
  // the same inputs and state give the same verdict, bit for bit, on every rank. With loss
  // scaling on, a nonfinite gradient with every loss finite (and no culprit named before the
  // sync) is an overflow: skipped with reason loss_scale_overflow whatever skip.enabled says,
  // outside the skip guards (the loss scale has its own), blaming no rank.
  Verdict decide(const std::vector<RankStats>& ranks, const Triage& triage = {}) const;
  // The record form (own_only()): the verdict of a result scored from the record (`mine`: this
  // rank's row), without names; needs_table says whether the step has something to explain,
  // and name() adds the names from every rank's row and own finding (gathered for it), in rank
  // order: what decide() gives from the table.
  bool own_only() const { return own_rank_ >= 0; }
  Verdict decide_own(const core::DecideResult& r, const RankStats& mine) const;
  static bool needs_table(const Verdict& v) { return v.anomalous() && !v.interrupted; }
  void name(Verdict& v, const std::vector<RankStats>& table,
            const std::vector<core::RankFinding>& findings) const;
  // Each rank's own values against its windows (scope.cpp).
  LocalFindings local_findings(const std::vector<RankStats>& ranks) const;
  // Advances the state with a decided step (the core's record_step and record_rank): a skip's
  // outlier never enters the windows; a clip enters them bounded to the windows' limits; a
  // salvage enters without the dropped ranks' values; an overflow backs the loss scale off; an
  // abort changes nothing but the core's sticky flag.
  void record(const Verdict& v);
  // skip.reset_guards_on_resume: the guards count from 0 again (the windows stay).
  void reset_guards();

  int64_t consecutive_skips() const { return state_.s.consecutive_skips; }
  int64_t history() const { return state_.s.grad_norms.size; }
  WindowSummary window() const;
  // Loss scaling (fp16): the scale the next step's loss is multiplied by (1 when off).
  bool loss_scaling() const { return config_.loss_scale.enabled; }
  double loss_scale() const { return state_.s.scale.scale; }
  int64_t consecutive_overflows() const { return state_.s.scale.consecutive_overflows; }

  const core::DecideConfig& config() const { return config_; }
  // The core's state for `world` ranks (this one, or resized): what the device decision uploads.
  HostDecideState state_for(int world) const;
  const HostDecideState& host_state() const { return state_; }

  // The windows and guards, and the loss scale, for checkpoints; doubles round-trip exactly
  // through JSON. load_loss_scale({}) keeps the fresh scale.
  nlohmann::json state() const;
  void load_state(const nlohmann::json& state);
  nlohmann::json loss_scale_state() const;
  void load_loss_scale(const nlohmann::json& state);

 private:
  // scope.cpp: names the scope, culprits and cause of a decided step.
  void attribute(Verdict& v, const std::vector<RankStats>& ranks, const LocalFindings& f,
                 const Triage& triage) const;
  std::string guard_message(const core::DecideResult& r, const HostDecideState& st) const;
  // The verdict's numbers from the core's result (decide and decide_own alike).
  Verdict verdict_of(const core::DecideResult& r, const HostDecideState& st) const;
  // Each rank's own values (unscaled by the verdict's loss scale), in rank order.
  static void add_rank_values(Verdict& v, const std::vector<RankStats>& ranks);

  // local_findings against `st`, the state for the table's world size.
  LocalFindings findings(const std::vector<RankStats>& ranks, const HostDecideState& st) const;

  core::DecideConfig config_;
  int64_t consecutive_tokens_;  // skip.max_consecutive_tokens, when it set max_consecutive
  int world_;                   // the job's ranks
  int own_rank_;                // the record form: this rank (its windows are the state's)
  HostDecideState state_;
};

}  // namespace lockstep
