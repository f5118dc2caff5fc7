// One step's decision, for the host and the device alike: score the exchanged table against the
// state (the global numbers, their z-scores, the reasons), decide (take, skip, clip or abort
// under the policy and the guards), record the decided step into the state. The host adds names
// (decide/detector.cpp); the device runs the same functions as a kernel (kernels/decide_step.cu).
//
// Bit-for-bit agreement: the same operations in the same order, fp64 throughout, one canonical
// NaN, and no FMA contraction (--fmad=false on the device, -ffp-contract=off on the host).
#pragma once

#include <cstdint>

#include "decide/core/guards.h"
#include "decide/core/rules.h"
#include "decide/core/windows.h"

namespace lockstep::core {

// Everything a decision reads and advances (host or device memory). The run's counters (steps,
// skips, clips) are the trainer's.
struct DecideState {
  Ring grad_norms, losses;  // the global windows (taken steps only)
  Ring recent;              // 0 / 1 (skipped) per decision, oldest first
  RankWindows ranks;        // each rank's own windows
  double* scratch;          // `world` doubles: the cross-rank median's sort
  int64_t recent_skips;     // the sum of `recent`
  LossScaleState scale;
  int64_t consecutive_skips;
  double consecutive_skip_seconds;  // the slowest rank's compute over those skips
  ZClipState zclip;
  int32_t aborted;  // sticky: every later decision is an abort
};

LOCKSTEP_HD inline void recent_push(DecideState& s, bool skipped) {
  if (s.recent.capacity == 0) return;
  if (s.recent.size == s.recent.capacity) s.recent_skips -= ring_at(s.recent, 0) != 0 ? 1 : 0;
  ring_push(s.recent, skipped ? 1.0 : 0.0);
  s.recent_skips += skipped ? 1 : 0;
}

// The doubles a state's rings take, in one block: the global windows, the recent decisions,
// each rank's windows (4 meta doubles and 2 windows per rank), the scratch.
inline int64_t decide_state_doubles(int64_t window, int64_t fraction_window, int world) {
  return 2 * window + fraction_window + world * (4 + 2 * window + 1);
}

// A fresh state over `rings` (decide_state_doubles of them, zero-filled, host or device memory).
inline DecideState fresh_decide_state(double* rings, int64_t window, int64_t fraction_window,
                                      int world, double scale) {
  DecideState s{};
  s.grad_norms = {rings, window, 0, 0};
  s.losses = {rings + window, window, 0, 0};
  s.recent = {rings + 2 * window, fraction_window, 0, 0};
  double* ranks = rings + 2 * window + fraction_window;
  s.ranks = {ranks, ranks + 4 * world, window};
  s.scratch = ranks + 4 * world + 2 * world * window;
  s.scale.scale = scale;
  return s;
}

// The same state over a copy of its block at `to` (the host's rings uploaded in one copy).
inline DecideState relocated(DecideState s, const double* from, double* to) {
  const auto move = [from, to](double* p) { return to + (p - from); };
  s.grad_norms.values = move(s.grad_norms.values);
  s.losses.values = move(s.losses.values);
  s.recent.values = move(s.recent.values);
  s.ranks.meta = move(s.ranks.meta);
  s.ranks.values = move(s.ranks.values);
  s.scratch = move(s.scratch);
  return s;
}

struct DecideConfig {
  Thresholds thresholds;
  int64_t min_history = 0;
  double max_norm = 0;  // training.max_norm: the clip
  LossScaleRule loss_scale;
  int64_t loss_scale_max_overflows = 0;
  double loss_scale_min = 0;
  int64_t max_consecutive = 0;  // skip guards
  double max_consecutive_seconds = 0;
  double max_fraction = 0;
  int64_t fraction_window = 0;
  GlobalSpike on_global_spike = kSpikeSkip;
  int32_t hardware_abort = 0;  // skip.on_hardware_fault = "abort"
  ZClipRule zclip;
};

// What the host settled before the sync (decide/triage.h: skip.scope = "rank", skip.replay, the
// probe); the device decides with none of it.
struct BeforeSync {
  const uint8_t* dropped;  // per rank (nullptr: none): its contribution was dropped
  int32_t culprits;        // local culprits named before the sync
  int32_t skip_step;       // their gradients stay bad and cannot all be dropped
  int32_t suspects;        // devices a replay or the probe blamed
};

enum Outcome : int32_t { kTake = 0, kSkipStep = 1, kAbortRun = 2 };

// The decided step (the device's is read by the host a step later; found_inf and grad_scale go
// to the fused AdamW at once).
struct DecideResult {
  double grad_norm, loss, grad_norm_z, loss_z, clip, loss_scale;
  double nonfinite, overflow_runs;  // the global counts: nonfinite elements, fp32-overflowed runs
  double clip_to;   // a clip decision's bound (0: none)
  double seconds;   // the slowest rank's compute seconds
  uint32_t reasons;  // Reason bits (an overflow: kNonfiniteGrad with `overflow`)
  Outcome outcome;
  Why why;
  int32_t overflow;     // loss scaling on, a nonfinite gradient and every loss finite
  int32_t clipped;      // taken, clipped: a global spike with skip.on_global_spike = "clip"
  int32_t salvaged;     // taken without the dropped ranks' contributions
  int32_t stop;         // a rank asked all to stop
  int32_t interrupted;  // a rank's step was cut short by a stop: nothing of it lands
  int64_t skips_in_window;  // for the max_fraction guard's message
};

// The scope of the step's anomaly from the table and the state (writes s.scratch).
LOCKSTEP_HD inline Scope scope_in(const double* table, int world, const DecideState& s,
                                  const DecideConfig& c, uint32_t reasons) {
  const auto finding = [&](int r) {
    const Ring g = rank_ring(s.ranks, r, kRankGradNorms), l = rank_ring(s.ranks, r, kRankLosses);
    return rank_finding(table + r * kStatsDoubles, s.scale.scale,
                        [&g](int64_t i) { return ring_at(g, i); }, g.size,
                        [&l](int64_t i) { return ring_at(l, i); }, l.size, c.min_history,
                        c.thresholds);
  };
  const auto stat = [table](int i, int f) { return table[i * kStatsDoubles + f]; };
  return scope_of(reasons, world, finding, stat, s.scratch, [](int) {});
}

// An anomalous step (not an overflow) under the policy: a global spike is clipped or aborted as
// skip.on_global_spike says; anything else is skipped unless a guard makes it an abort.
// `scope(reasons)`: the anomaly's scope, asked only when the policy needs it.
template <class ScopeOf>
LOCKSTEP_HD void apply_policy(const DecideState& s, const DecideConfig& c, bool settled_local,
                              const ScopeOf& scope, DecideResult& out) {
  const bool nonfinite = (out.reasons & kNonfinite) != 0;
  const bool zclip_only = out.reasons == kGradNormZClip;  // ZClip clips, never skips
  if ((zclip_only || c.on_global_spike != kSpikeSkip) && !nonfinite && !settled_local &&
      scope(out.reasons) == kGlobal) {
    if (!zclip_only && c.on_global_spike == kSpikeAbort) {
      out.outcome = kAbortRun;
      out.why = kGlobalSpikeAbort;
      return;
    }
    const auto gn = [&s](int64_t i) { return ring_at(s.grad_norms, i); };
    const double zclip_to = zclip_bound(s.zclip, c.zclip, out.grad_norm);
    out.outcome = kTake;
    out.clipped = 1;
    out.clip_to = zclip_to > 0 ? zclip_to
                               : spike_clip_to(out.reasons, gn, s.grad_norms.size, c.thresholds);
    return;
  }
  const bool oldest = s.recent.size > 0 && ring_at(s.recent, 0) != 0;
  out.why = guard_tripped(s.consecutive_skips, c.max_consecutive, s.recent_skips, s.recent.size,
                          oldest, c.max_fraction, c.fraction_window,
                          s.consecutive_skip_seconds + out.seconds, c.max_consecutive_seconds,
                          &out.skips_in_window);
  out.outcome = out.why == kNoWhy ? kSkipStep : kAbortRun;
}

// The global numbers unscaled, with their z-scores and reasons; `seconds`: the slowest rank's
// compute, `salvaged`: some rank's contribution was dropped.
LOCKSTEP_HD inline void score_global(const Global& g, double seconds, bool salvaged,
                                     const DecideState& s, const DecideConfig& c,
                                     const BeforeSync& before, DecideResult& out) {
  out = DecideResult{};
  out.seconds = seconds;
  out.salvaged = salvaged ? 1 : 0;
  out.loss_scale = s.scale.scale;
  out.grad_norm = canonical(s.scale.scale != 1.0 ? g.grad_norm / s.scale.scale : g.grad_norm);
  out.loss = g.loss;
  out.stop = g.stop ? 1 : 0;
  out.interrupted = g.interrupted ? 1 : 0;
  out.nonfinite = g.nonfinite;
  out.overflow_runs = g.overflow_runs;
  out.clip = 1.0;
  out.overflow =
      c.loss_scale.enabled && g.nonfinite > 0 && !g.loss_nonfinite && before.culprits == 0;
  const bool zscores = s.grad_norms.size >= c.min_history && !out.overflow;
  const auto gn = [&s](int64_t i) { return ring_at(s.grad_norms, i); };
  const auto ls = [&s](int64_t i) { return ring_at(s.losses, i); };
  out.grad_norm_z = zscores && std::isfinite(out.grad_norm)
                        ? window_zscore(gn, s.grad_norms.size, out.grad_norm)
                        : nan_value();
  out.loss_z = zscores && std::isfinite(out.loss) ? window_zscore(ls, s.losses.size, out.loss)
                                                  : nan_value();
  out.reasons = reasons_of(g, out.grad_norm, out.grad_norm_z, out.loss_z, c.thresholds);
  const double zclip_z = zclip_zscore(s.zclip, c.zclip, out.grad_norm);
  if (c.thresholds.enabled && !out.overflow && zclip_z > c.zclip.z) out.reasons |= kGradNormZClip;
}

// The global numbers from the table: reduced in rank order (without the dropped ranks' losses).
LOCKSTEP_HD inline void score_numbers(const double* table, int world, const DecideState& s,
                                      const DecideConfig& c, const BeforeSync& before,
                                      DecideResult& out) {
  const auto stat = [table](int i, int f) { return table[i * kStatsDoubles + f]; };
  const auto dropped = [&before](int i) { return before.dropped && before.dropped[i] != 0; };
  bool salvaged = false;
  double seconds = 0;
  for (int i = 0; i < world; ++i) {
    salvaged = salvaged || dropped(i);
    seconds = max_of(seconds, stat(i, kComputeSeconds));
  }
  score_global(reduce_in_rank_order(stat, world, dropped), seconds, salvaged, s, c, before, out);
}

// The outcome of a step whose numbers `out` holds; `scope(reasons)` as apply_policy's.
template <class ScopeOf>
LOCKSTEP_HD void score_outcome(const DecideState& s, const DecideConfig& c,
                               const BeforeSync& before, const ScopeOf& scope,
                               DecideResult& out) {
  if (out.interrupted) {  // a partial gradient: not an update, not a skip to count
    out.outcome = kSkipStep;
    out.why = kInterrupted;
    out.overflow = out.salvaged = 0;
    return;
  }
  if (out.overflow) {  // the loss scale, not the data: skipped, backed off, its own guards
    out.why = scale_guard(s.scale, c.loss_scale, c.loss_scale_max_overflows, c.loss_scale_min);
    out.outcome = out.why == kNoWhy ? kSkipStep : kAbortRun;
    out.salvaged = 0;
    return;
  }
  if (out.reasons != 0 || before.skip_step) {
    out.salvaged = 0;
    if (!c.thresholds.enabled) {  // stock behaviour: a nonfinite value stops the job
      out.outcome = kAbortRun;
      out.why = kSkipDisabled;
      return;
    }
    apply_policy(s, c, before.culprits > 0, scope, out);
  }
  if (out.outcome != kAbortRun && before.suspects > 0 && c.hardware_abort) {
    out.outcome = kAbortRun;
    out.why = kHardwareFaultAbort;
    out.clipped = out.salvaged = 0;
    return;
  }
  if (out.outcome == kTake)
    out.clip = clip_coefficient(out.grad_norm, clip_limit(out.clip_to, c.max_norm));
}

// The numbers and the outcome of one step from the table; `s` is not changed (but for its
// scratch).
LOCKSTEP_HD inline void score_step(const double* table, int world, const DecideState& s,
                                   const DecideConfig& c, const BeforeSync& before,
                                   DecideResult& out) {
  score_numbers(table, world, s, c, before, out);
  const auto scope = [&](uint32_t reasons) { return scope_in(table, world, s, c, reasons); };
  score_outcome(s, c, before, scope, out);
}

// The decided step's effect on the global state. An abort or an interrupted step sets the
// sticky flag only; an overflow backs the loss scale off; a skip counts toward the guards; a
// taken step (bounded to the windows' limits when clipped) enters the windows.
LOCKSTEP_HD inline void record_step(DecideState& s, const DecideConfig& c,
                                    const DecideResult& r) {
  if (r.outcome == kAbortRun || r.interrupted) {
    s.aborted = 1;
    return;
  }
  if (r.overflow) {
    loss_scale_record(s.scale, c.loss_scale, true, false);
    return;
  }
  const bool skipped = r.outcome == kSkipStep;
  if (skipped) {
    ++s.consecutive_skips;
    // measured time, not reproducible: counted only for the guard that reads it
    if (c.max_consecutive_seconds > 0) s.consecutive_skip_seconds += r.seconds;
  } else {
    s.consecutive_skips = 0;
    s.consecutive_skip_seconds = 0;
    const auto ls = [&s](int64_t i) { return ring_at(s.losses, i); };
    const double loss = r.clipped ? window_bounded(ls, s.losses.size, r.loss,
                                                   c.thresholds.loss_zscore, c.min_history)
                                  : r.loss;
    const double taken =
        r.clipped && r.clip_to > 0 ? min_of(r.grad_norm, r.clip_to) : r.grad_norm;
    ring_push(s.grad_norms, taken);
    ring_push(s.losses, loss);
    zclip_record(s.zclip, c.zclip, taken);
  }
  recent_push(s, skipped);
  loss_scale_record(s.scale, c.loss_scale, false, !skipped);
}

// A taken step's values `v` enter rank `rank`'s own windows, bounded on a clip (ranks are
// independent: the device records them in parallel).
LOCKSTEP_HD inline void record_rank_values(DecideState& s, const DecideConfig& c,
                                           const DecideResult& r, int rank, RankValues v) {
  if (r.outcome != kTake || r.overflow) return;
  const double values[2] = {v.grad_norm, v.loss};
  const double zs[2] = {c.thresholds.grad_norm_zscore, c.thresholds.loss_zscore};
  for (int k = 0; k < 2; ++k) {
    const Ring w = rank_ring(s.ranks, rank, k);
    const auto at = [&w](int64_t i) { return ring_at(w, i); };
    rank_ring_push(s.ranks, rank, k,
                   r.clipped ? window_bounded(at, w.size, values[k], zs[k], c.min_history)
                             : values[k]);
  }
}

// The same from the exchanged table; a dropped rank's values do not enter.
LOCKSTEP_HD inline void record_rank(DecideState& s, const DecideConfig& c, const double* table,
                                    const DecideResult& r, const BeforeSync& before, int rank) {
  if (before.dropped && before.dropped[rank] != 0) return;
  record_rank_values(s, c, r, rank, rank_values(table + rank * kStatsDoubles, r.loss_scale));
}

// After an abort every decision is one: nothing lands.
LOCKSTEP_HD inline void sticky_abort(const DecideState& s, DecideResult& out, float* found_inf,
                                     float* grad_scale) {
  out = DecideResult{};
  out.outcome = kAbortRun;
  out.why = kStickyAbort;
  out.clip = 1.0;
  out.loss_scale = s.scale.scale;
  *found_inf = 1.0f;
  *grad_scale = 1.0f;
}

// The step's decision and its effect on the global state, with nothing settled before the sync
// (the device's thread 0): found_inf = 1 blocks the fused AdamW on a skip or an abort, and
// grad_scale = loss scale / clip.
LOCKSTEP_HD inline void decide_global(const double* table, int world, DecideState& s,
                                      const DecideConfig& c, DecideResult& out, float* found_inf,
                                      float* grad_scale) {
  if (s.aborted) {
    sticky_abort(s, out, found_inf, grad_scale);
    return;
  }
  score_step(table, world, s, c, BeforeSync{}, out);
  *found_inf = out.outcome == kTake ? 0.0f : 1.0f;
  *grad_scale = static_cast<float>(out.loss_scale / out.clip);
  record_step(s, c, out);
}

// The whole step on one thread: the host's form of the device's kernel.
LOCKSTEP_HD inline void decide_step(const double* table, int world, DecideState& s,
                                    const DecideConfig& c, DecideResult& out, float* found_inf,
                                    float* grad_scale) {
  decide_global(table, world, s, c, out, found_inf, grad_scale);
  for (int r = 0; r < world; ++r) record_rank(s, c, table, out, BeforeSync{}, r);
}

}  // namespace lockstep::core
