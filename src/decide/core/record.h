// The decision from a fixed-size record instead of the [W, 9] table: its cost per rank does not
// grow with the world. Each rank keeps only its own windows, judges its own row against them
// (its finding), and contributes one record; an all-reduce adds the records' integers (exact
// sums of the doubles, counts) and another takes the largest of two numbers, so every rank holds
// the same record by construction, whatever order the backend adds in. The decision read from
// it equals the table's (score_step) bit for bit: the same sums (exact.h), the same counts, the
// same scope. When the scope rests on the ranks' norms against each other (no rank stands out
// against its own windows), one more all-reduce of one count settles it (record_below).
//
//   record_contribution(row, dropped, finding)   this rank's part
//   all-reduce: sums (add), maxes (largest)       identical on every rank
//   [record_below: one count, added]              only when score_record asks for it
//   score_record / decide_record                  the step, as score_step / decide_global
//   record_own                                    this rank's own windows
#pragma once

#include <cstdint>

#include "decide/core/exact.h"
#include "decide/core/step.h"

namespace lockstep::core {

// Nonfinite counts travel in units of 2^-20 of an element: a rank holding one of several copies
// of an element weighs its count by 1 / holders (check/layout.h), which adds up exactly for a
// power-of-two number of holders; whole counts are exact below 2^43 elements.
constexpr double kCountUnits = 1048576.0;

// The added part: every field an int64, so the whole struct is one int64 tensor to all-reduce.
struct RecordSums {
  ExactSum shard_sumsq;  // of every rank's shard: the global norm
  ExactSum loss;         // of the contributing (not dropped) ranks' losses
  int64_t nonfinite;     // gradient elements, in kCountUnits
  int64_t overflow_runs;
  int64_t stops;        // ranks asking to stop (stop_requested != 0)
  int64_t interrupts;   // ranks whose step a stop cut short (stop_requested >= 2)
  int64_t contributing;
  int64_t dropped;
  int64_t outliers;  // ranks whose own finding has reasons
  int64_t samples;   // ranks whose samples name themselves
  int64_t unmeasured;  // ranks without a compute time yet (the straggler watch skips the step)
};
// The largest part: non-negative doubles as their bits (which order as the doubles do).
struct RecordMaxes {
  int64_t compute_seconds;
  int64_t local_sumsq;  // the largest own sum of squares (the cross-rank test)
};
struct StepRecord {
  RecordSums sums;
  RecordMaxes maxes;
};
constexpr int kRecordSums = static_cast<int>(sizeof(RecordSums) / sizeof(int64_t));
constexpr int kRecordMaxes = static_cast<int>(sizeof(RecordMaxes) / sizeof(int64_t));
static_assert(sizeof(RecordSums) == kRecordSums * sizeof(int64_t));
static_assert(sizeof(RecordMaxes) == kRecordMaxes * sizeof(int64_t));

LOCKSTEP_HD inline int64_t ordered_bits(double v) {  // v >= 0, not NaN
#if defined(__CUDA_ARCH__)
  return __double_as_longlong(v);
#else
  int64_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
#endif
}
LOCKSTEP_HD inline double from_ordered_bits(int64_t b) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(b);
#else
  double v;
  std::memcpy(&v, &b, sizeof v);
  return v;
#endif
}

// This rank's own values against its own windows (rank 0 of `own`: a state for one rank).
LOCKSTEP_HD inline RankFinding own_finding(const double* row, const DecideState& own,
                                           const DecideConfig& c) {
  const Ring g = rank_ring(own.ranks, 0, kRankGradNorms), l = rank_ring(own.ranks, 0, kRankLosses);
  return rank_finding(row, own.scale.scale, [&g](int64_t i) { return ring_at(g, i); }, g.size,
                      [&l](int64_t i) { return ring_at(l, i); }, l.size, c.min_history,
                      c.thresholds);
}

// This rank's record: its row, whether the triage dropped its contribution, its own finding.
LOCKSTEP_HD inline void record_contribution(const double* row, bool dropped, const RankFinding& f,
                                            StepRecord& out) {
  RecordSums& s = out.sums;
  exact_zero(s.shard_sumsq);
  exact_zero(s.loss);
  exact_add(s.shard_sumsq, row[kShardSumsq]);
  if (!dropped) exact_add(s.loss, row[kLoss]);
  exact_normalize(s.shard_sumsq);  // each digit below 2^32: room for 2^31 ranks
  exact_normalize(s.loss);
  s.nonfinite = static_cast<int64_t>(row[kShardNonfinite] * kCountUnits + 0.5);
  s.overflow_runs = static_cast<int64_t>(row[kOverflowRuns]);
  s.stops = row[kStopRequested] != 0 ? 1 : 0;
  s.interrupts = row[kStopRequested] >= 2 ? 1 : 0;
  s.contributing = dropped ? 0 : 1;
  s.dropped = dropped ? 1 : 0;
  s.outliers = f.reasons != 0 ? 1 : 0;
  s.samples = f.samples ? 1 : 0;
  s.unmeasured = row[kComputeSeconds] > 0 ? 0 : 1;
  out.maxes.compute_seconds = ordered_bits(max_of(0.0, row[kComputeSeconds]));
  out.maxes.local_sumsq = ordered_bits(max_of(0.0, row[kLocalSumsq]));
}

// What the all-reduces do, for one process holding several ranks' records (tests, benches).
LOCKSTEP_HD inline void record_combine(StepRecord& into, const StepRecord& r) {
  auto* a = reinterpret_cast<int64_t*>(&into.sums);
  const auto* b = reinterpret_cast<const int64_t*>(&r.sums);
  for (int i = 0; i < kRecordSums; ++i) a[i] += b[i];
  into.maxes.compute_seconds = into.maxes.compute_seconds < r.maxes.compute_seconds
                                   ? r.maxes.compute_seconds
                                   : into.maxes.compute_seconds;
  into.maxes.local_sumsq =
      into.maxes.local_sumsq < r.maxes.local_sumsq ? r.maxes.local_sumsq : into.maxes.local_sumsq;
}

// This rank's part of the count the cross-rank test needs (added over the ranks): whether its
// own sum of squares, times 16, is below the largest.
LOCKSTEP_HD inline int64_t record_below(const double* row, const StepRecord& all) {
  return 16.0 * max_of(0.0, row[kLocalSumsq]) < from_ordered_bits(all.maxes.local_sumsq) ? 1 : 0;
}

// The scope from the record: ranks that stand out against their own windows, else (a norm
// reason) whether some rank's norm stands out against the others' (cross_rank_outliers): the
// largest sum above 16x the ((world - 1) / 2)-th smallest, that is at least (world - 1) / 2 + 1
// ranks 16x below the largest (`below`; < 0: not counted yet, and *missing is set).
LOCKSTEP_HD inline Scope record_scope(const StepRecord& all, int world, uint32_t reasons,
                                      int64_t below, bool* missing) {
  const int64_t outliers = all.sums.outliers;
  if (outliers > 0 || (reasons & kNormReasons) == 0)
    return is_local(static_cast<int>(outliers), world, all.sums.samples > 0) ? kLocal : kGlobal;
  if (world < 2) return kGlobal;
  if (below < 0) {
    *missing = true;
    return kGlobal;
  }
  return below >= (world - 1) / 2 + 1 ? kLocal : kGlobal;  // at most half: local
}

// The step from the record, as score_step from the table. `before.dropped` is not read (the
// record counts the dropped ranks). Returns false when the scope needs `below` (record_below,
// added over the ranks) and it is < 0: count it and score again.
LOCKSTEP_HD inline bool score_record(const StepRecord& all, int world, int64_t below,
                                     const DecideState& s, const DecideConfig& c,
                                     const BeforeSync& before, DecideResult& out) {
  const RecordSums& t = all.sums;
  Global g;
  g.nonfinite = static_cast<double>(t.nonfinite) / kCountUnits;
  g.overflow_runs = static_cast<double>(t.overflow_runs);
  g.stop = t.stops > 0;
  g.interrupted = t.interrupts > 0;
  g.loss_nonfinite = t.loss.nan + t.loss.pos_inf + t.loss.neg_inf > 0;
  g = finish_global(g, exact_value(t.shard_sumsq), exact_value(t.loss), t.contributing);
  score_global(g, from_ordered_bits(all.maxes.compute_seconds), t.dropped > 0, s, c, before, out);
  bool missing = false;
  const auto scope = [&](uint32_t reasons) {
    return record_scope(all, world, reasons, below, &missing);
  };
  score_outcome(s, c, before, scope, out);
  return !missing;
}

// The step's decision and its effect on the global state from the record, as decide_global (the
// device's thread 0). Returns false, deciding nothing, when `below` is needed and < 0.
LOCKSTEP_HD inline bool decide_record(const StepRecord& all, int world, int64_t below,
                                      DecideState& s, const DecideConfig& c, DecideResult& out,
                                      float* found_inf, float* grad_scale) {
  if (s.aborted) {
    sticky_abort(s, out, found_inf, grad_scale);
    return true;
  }
  if (!score_record(all, world, below, s, c, BeforeSync{}, out)) return false;
  *found_inf = out.outcome == kTake ? 0.0f : 1.0f;
  *grad_scale = static_cast<float>(out.loss_scale / out.clip);
  record_step(s, c, out);
  return true;
}

// This rank's own windows after the decided step (a dropped rank's values do not enter).
LOCKSTEP_HD inline void record_own(DecideState& own, const DecideConfig& c, const double* row,
                                   bool dropped, const DecideResult& r) {
  if (dropped) return;
  record_rank_values(own, c, r, 0, rank_values(row, r.loss_scale));
}

// The device's form, in three kernels of one thread around the collectives: this rank's part
// (nothing dropped before the sync there), then its part of the cross-rank count (always
// counted on the device: a decision never waits for the host to ask), then the step and this
// rank's own windows. No work grows with the world.
LOCKSTEP_HD inline void record_contribute(const double* row, const DecideState& own,
                                          const DecideConfig& c, StepRecord& out) {
  record_contribution(row, false, own_finding(row, own, c), out);
}
LOCKSTEP_HD inline void decide_record_step(const StepRecord& all, int world, int64_t below,
                                           const double* row, DecideState& s,
                                           const DecideConfig& c, DecideResult& out,
                                           float* found_inf, float* grad_scale) {
  decide_record(all, world, below, s, c, out, found_inf, grad_scale);
  record_own(s, c, row, false, out);  // an abort's result enters nothing
}

}  // namespace lockstep::core
