// The record form of the decision on the host (decide/core/record.h): this rank keeps the global
// state and its own windows only (a state for one rank: its memory does not grow with the
// world), contributes one record per step and reads the decision from the record every rank
// holds after two fixed-size all-reduces (the exact sums and counts added, the largest numbers
// taken), plus one all-reduce of one count on the rare step whose scope rests on the ranks'
// norms against each other. What it decides is what the table decides (SkipDetector::decide
// over the all-gathered [W, 9] rows), bit for bit; the table is gathered only on a step to
// explain, for the names (each rank's row and its own finding).
//
//   score_by_record     the exchange and the step's result (the state unchanged)
//   decide_by_record    the trainer's verdict, named on a step to explain (skip.exchange)
//   name_by_record      the names: every rank's row and own finding, gathered
//   record_state        the checkpoint's windows: every rank's own, gathered at the save
//   RecordDecider       a state and the decision alone (lockstep bench decision / agree)
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "decide/core/record.h"
#include "decide/judge.h"
#include "lockstep/decision.h"

namespace lockstep {

// Every rank's records combined: the sums added, the maxes taken (a null comm: one rank).
core::StepRecord exchange_record(const core::StepRecord& mine, Comm* comm);
// The cross-rank count (core::record_below) added over the ranks.
int64_t exchange_count(int64_t mine, Comm* comm);

struct RecordStep {
  core::DecideResult result{};
  core::StepRecord record{};  // every rank's, combined
  core::RankFinding own{};    // this rank's row against its own windows
  bool counted = false;       // the scope needed the cross-rank count (a third all-reduce)
};
// This rank's row (`dropped`: the triage dropped its contribution) against `s`, a state for one
// rank; every rank calls it in the same step with the same `before` (its `dropped` not read).
// The step's result; `s` is not changed (core::record_step and record_own do that).
RecordStep score_by_record(const RankStats& mine, bool dropped, const core::BeforeSync& before,
                           const core::DecideState& s, const core::DecideConfig& c, Comm* comm);

// The trainer's step in the record form (the judge's detector holds this rank's windows only):
// the verdict the table form gives, with its names (every rank's values and findings, the
// culprits) only where there is something to explain, then `table` holds every rank's row.
struct RecordVerdict {
  Verdict verdict;
  std::vector<RankStats> table;  // empty on a step with nothing to explain
  bool all_measured = false;     // every rank measured its compute time (stragglers)
};
RecordVerdict decide_by_record(const SkipDetector& detector, const RankStats& mine, Comm* comm);
// A step to explain: every rank's row and own finding gathered (`own`: this rank's), the names
// added to `v` (SkipDetector::name); returns the rows, in rank order. The device's record form
// reads its verdict a step later and names it here too.
std::vector<RankStats> name_by_record(const SkipDetector& detector, Verdict& v,
                                      const RankStats& mine, const core::RankFinding& own,
                                      Comm* comm);
// The same for a device-decided step read a step later (`late.mine` set: the record form), when
// it has something to explain: its table then holds the rows.
void name_by_record(const SkipDetector& detector, StepJudge::Checked& late, Comm* comm);

// The judge's state as the table form saves it (every rank's own windows, gathered; every rank
// calls it at the save). The table form's: judge.state() itself.
nlohmann::json record_state(const StepJudge& judge, Comm* comm);

class RecordDecider {
 public:
  // The state a SkipDetector starts from (`window`, `fraction_window`, the loss scale).
  RecordDecider(const core::DecideConfig& config, int64_t window, int64_t fraction_window,
                double loss_scale);
  RecordDecider(const RecordDecider&) = delete;
  RecordDecider& operator=(const RecordDecider&) = delete;

  // Decides and records: the global state and this rank's own windows advance.
  RecordStep decide(const RankStats& mine, bool dropped, const core::BeforeSync& before,
                    Comm* comm);

  const core::DecideState& state() const { return s_; }
  // The bytes this rank holds for the decision, and exchanges per step (without the count).
  size_t state_bytes() const { return rings_.size() * sizeof(double) + sizeof s_; }
  static constexpr size_t kExchangedBytes = sizeof(core::StepRecord);

 private:
  core::DecideConfig config_;
  std::vector<double> rings_;
  core::DecideState s_;
};

}  // namespace lockstep
