// What a step is judged by: the numbers every rank exchanges, the global numbers reduced from
// them in rank order, the thresholds that name a step's reasons, the anomaly's scope (a minority
// of ranks, or most of them) and the clip a taken step gets (training.max_norm, ZClip's bound).
#pragma once

#include <cstdint>

#include "decide/core/exact.h"
#include "decide/core/windows.h"

namespace lockstep::core {

// One rank's row of the exchanged [W, kStatsDoubles] table: the layout of lockstep::RankStats
// (include/lockstep/decision.h asserts each field's offset against these).
enum StatsField : int {
  kShardNonfinite = 0,
  kShardSumsq = 1,
  kLocalNonfinite = 2,
  kLocalSumsq = 3,
  kLoss = 4,
  kStopRequested = 5,  // 1: stop after this step; 2: a stop cut this rank's step short
  kOverflowRuns = 6,
  kBadSamples = 7,
  kComputeSeconds = 8,
  kStatsDoubles = 9
};

// Never a partial norm as the norm.
LOCKSTEP_HD inline double norm_of(double nonfinite, double sumsq) {
  return nonfinite > 0 ? nan_value() : std::sqrt(sumsq);
}

struct Global {
  double nonfinite = 0, sumsq = 0, overflow_runs = 0;
  double grad_norm = 0;  // of the gradient as synced (still times the loss scale)
  double loss = 0;       // the mean over the contributing ranks; NaN when none contributes
  bool stop = false, loss_nonfinite = false;
  bool interrupted = false;  // some rank's gradient is partial: a stop cut its step short
};

// The norm and the mean loss from the summed numbers (`contributing` ranks' losses).
LOCKSTEP_HD inline Global finish_global(Global g, double sumsq, double loss_sum,
                                        int64_t contributing) {
  g.sumsq = sumsq;
  g.grad_norm = norm_of(g.nonfinite, sumsq);
  g.loss = contributing == 0 ? nan_value()
                             : canonical(loss_sum / static_cast<double>(contributing));
  return g;
}

// Every rank adds the same numbers in the same order. `stat(i, f)`: field f of rank i's row;
// `dropped(i)`: rank i's contribution was dropped (its loss does not count).
// The sums of squares and of the losses are exact (exact.h): the same bits in any order, so the
// fixed-size record (record.h) reduced by an all-reduce gives what this table gives.
template <class Stat, class Dropped>
LOCKSTEP_HD Global reduce_in_rank_order(const Stat& stat, int world, const Dropped& dropped) {
  Global g;
  ExactSum sumsq, loss_sum;
  exact_zero(sumsq);
  exact_zero(loss_sum);
  int contributing = 0;
  for (int i = 0; i < world; ++i) {
    g.nonfinite += stat(i, kShardNonfinite);
    exact_add(sumsq, stat(i, kShardSumsq));
    g.overflow_runs += stat(i, kOverflowRuns);
    g.stop = g.stop || stat(i, kStopRequested) != 0;
    g.interrupted = g.interrupted || stat(i, kStopRequested) >= 2;
    if (dropped(i)) continue;
    const double loss = stat(i, kLoss);
    exact_add(loss_sum, loss);
    ++contributing;
    g.loss_nonfinite = g.loss_nonfinite || !std::isfinite(loss);
  }
  return finish_global(g, exact_value(sumsq), exact_value(loss_sum), contributing);
}

// ---- reasons ----------------------------------------------------------------------------------

// Why a step is not clean, as bits in the order their names are listed (decide/names.cpp). The
// core sets the first six; the host adds what only it sees.
enum Reason : uint32_t {
  kNonfiniteGrad = 1u << 0,
  kNonfiniteLoss = 1u << 1,
  kGradNormAboveMax = 1u << 2,
  kGradNormSpike = 1u << 3,
  kLossSpike = 1u << 4,
  kGradNormZClip = 1u << 5,     // above ZClip's EMA bound (skip.adaptive_clip = "zclip")
  kLossScaleOverflow = 1u << 6,  // host: an fp16 overflow, not bad data (alone)
  kReplayMismatch = 1u << 7,    // host: the probe's replay differs from the first computation
  kDesync = 1u << 8,            // host: the replica vote found diverged replicas
};
constexpr int kReasonCount = 9;
constexpr uint32_t kNonfinite = kNonfiniteGrad | kNonfiniteLoss;
constexpr uint32_t kNormReasons = kGradNormAboveMax | kGradNormSpike | kGradNormZClip;
constexpr uint32_t kSpikes = kNormReasons | kLossSpike;
constexpr uint32_t kCoreReasons = kNonfinite | kSpikes;  // the bits the core sets

struct Thresholds {
  bool enabled = false;         // skip.enabled: the thresholds below apply
  double max_grad_norm = 0;     // 0 = off
  double grad_norm_zscore = 0;  // 0 = off
  double loss_zscore = 0;       // 0 = off
};

// `grad_norm` unscaled; z-scores NaN while the windows are short.
LOCKSTEP_HD inline uint32_t reasons_of(const Global& g, double grad_norm, double grad_norm_z,
                                       double loss_z, const Thresholds& t) {
  uint32_t r = 0;
  if (g.nonfinite > 0) r |= kNonfiniteGrad;
  if (g.loss_nonfinite) r |= kNonfiniteLoss;
  if (!t.enabled) return r;
  if (t.max_grad_norm > 0 && std::isfinite(grad_norm) && grad_norm > t.max_grad_norm)
    r |= kGradNormAboveMax;
  if (t.grad_norm_zscore > 0 && grad_norm_z > t.grad_norm_zscore) r |= kGradNormSpike;
  if (t.loss_zscore > 0 && loss_z > t.loss_zscore) r |= kLossSpike;
  return r;
}

// ---- scope: a minority of ranks, or most of them ----------------------------------------------

enum Scope : int32_t { kNoScope = 0, kLocal = 1, kGlobal = 2 };

// One rank's own values against its own windows (z-scores NaN while they are short).
struct RankFinding {
  uint32_t reasons = 0;  // kNonfiniteGrad, kNonfiniteLoss, kGradNormSpike, kLossSpike
  bool samples = false;  // samples of its batch whose own loss is nonfinite name themselves
  double grad_norm_z = 0, loss_z = 0;
};

// A rank's own values as its windows hold them (`scale`: the loss scale its gradient carries).
struct RankValues {
  double grad_norm, loss;
};
LOCKSTEP_HD inline RankValues rank_values(const double* row, double scale) {
  return {canonical(norm_of(row[kLocalNonfinite], row[kLocalSumsq]) / scale),
          canonical(row[kLoss])};
}

template <class GAt, class LAt>
LOCKSTEP_HD RankFinding rank_finding(const double* row, double scale, const GAt& gn,
                                     int64_t gn_size, const LAt& ls, int64_t ls_size,
                                     int64_t min_history, const Thresholds& t) {
  RankFinding f;
  f.grad_norm_z = f.loss_z = nan_value();
  const double loss = row[kLoss];
  if (row[kLocalNonfinite] > 0) f.reasons |= kNonfiniteGrad;
  if (!std::isfinite(loss) || row[kBadSamples] > 0) f.reasons |= kNonfiniteLoss;
  f.samples = row[kBadSamples] > 0;
  if (ls_size < min_history) return f;
  const double g = rank_values(row, scale).grad_norm;
  if (std::isfinite(g)) f.grad_norm_z = window_zscore(gn, gn_size, g);
  if (std::isfinite(loss)) f.loss_z = window_zscore(ls, ls_size, loss);
  if (t.grad_norm_zscore > 0 && f.grad_norm_z > t.grad_norm_zscore) f.reasons |= kGradNormSpike;
  if (t.loss_zscore > 0 && f.loss_z > t.loss_zscore) f.reasons |= kLossSpike;
  return f;
}

// Some ranks stand out, at most half of them (or samples name themselves).
LOCKSTEP_HD inline bool is_local(int outliers, int world, bool sample_evidence) {
  return outliers > 0 && (sample_evidence || 2 * outliers <= world);
}

// Before the windows fill (skip.max_grad_norm acts from the first step): the ranks whose own
// gradient norm exceeds 4x the median of the others' (squared: 16x), each passed to `flag` in
// rank order (a sum below 0 or NaN counts as 0). `scratch`: `world` doubles. At most half the
// ranks can stand out this way (each is above the median), and some do exactly when the largest
// sum is above 16x the ((world - 1) / 2)-th smallest: what the record form counts (record.h).
template <class Stat, class Flag>
LOCKSTEP_HD int cross_rank_outliers(const Stat& stat, int world, double* scratch,
                                    const Flag& flag) {
  if (world < 2) return 0;
  for (int i = 0; i < world; ++i) scratch[i] = max_of(0.0, stat(i, kLocalSumsq));
  sort_ascending(scratch, world);
  int n = 0;
  for (int r = 0; r < world; ++r) {
    const double v = max_of(0.0, stat(r, kLocalSumsq));
    if (!(v > 16.0 * median_of_others(scratch, world, v))) continue;
    flag(r);
    ++n;
  }
  return n;
}

// The scope of an anomaly whose global reasons are `reasons`, for the host and the device: each
// rank's own finding (`finding(r)`), and when none stands out and the norm is the reason, the
// ranks' norms against each other's. `outlier(r)` hears each rank that stands out.
template <class Finding, class Stat, class Outlier>
LOCKSTEP_HD Scope scope_of(uint32_t reasons, int world, const Finding& finding, const Stat& stat,
                           double* scratch, const Outlier& outlier) {
  int outliers = 0;
  bool samples = false;
  for (int r = 0; r < world; ++r) {
    const RankFinding f = finding(r);
    samples = samples || f.samples;
    if (f.reasons == 0) continue;
    ++outliers;
    outlier(r);
  }
  if (outliers == 0 && (reasons & kNormReasons) != 0) {
    outliers = cross_rank_outliers(stat, world, scratch, outlier);
    samples = false;
  }
  return is_local(outliers, world, samples) ? kLocal : kGlobal;
}

// ---- the clip ---------------------------------------------------------------------------------

// The factor the update is scaled by so the global norm is at most max_norm (1: no clip).
LOCKSTEP_HD inline double clip_coefficient(double total_norm, double max_norm) {
  if (max_norm <= 0 || !std::isfinite(total_norm)) return 1.0;
  return min_of(1.0, max_norm / (total_norm + 1e-6));
}

// training.max_norm, or a clip decision's bound (`clip_to` > 0) when that is lower.
LOCKSTEP_HD inline double clip_limit(double clip_to, double max_norm) {
  return clip_to > 0 && (max_norm <= 0 || clip_to < max_norm) ? clip_to : max_norm;
}

// What skip.on_global_spike does with an anomaly on most ranks (a nonfinite one is skipped).
enum GlobalSpike : int32_t { kSpikeClip = 0, kSpikeSkip = 1, kSpikeAbort = 2 };

// A clip decision's bound: the largest global norm the windows accept (mean + z * std) and
// skip.max_grad_norm, whichever acted; 0 when neither did.
template <class At>
LOCKSTEP_HD double spike_clip_to(uint32_t reasons, const At& gn, int64_t n, const Thresholds& t) {
  double to = inf_value();
  if (reasons & kGradNormSpike)
    to = min_of(to, window_mean(gn, n) + t.grad_norm_zscore * window_stddev(gn, n));
  if (reasons & kGradNormAboveMax) to = min_of(to, t.max_grad_norm);
  return std::isfinite(to) ? to : 0.0;
}

// ---- ZClip (arXiv 2504.02507): an EMA of the global norm, skip.adaptive_clip = "zclip" --------
//
// The first `warmup` taken norms give the mean and population variance (Welford); after them
// each taken norm g moves mean = a * mean + (1 - a) * g, var = a * var + (1 - a) * (g - mean)^2.
// A norm with z = (g - mean) / (std + 1e-6) above z_t is clipped to mean + z_t * std / (z / z_t).
// Unlike the reference code the state is checkpointed and only taken, finite norms enter it.

struct ZClipRule {
  int32_t enabled = 0;
  double alpha = 0.97, z = 2.5;
  int64_t warmup = 25;
};

struct ZClipState {
  int64_t count;         // norms taken in, up to warmup (then it stays there)
  double mean, m2, var;  // m2: the warm-up's running sum of squared deviations
};

// NaN while warming up, off, or for a nonfinite norm.
LOCKSTEP_HD inline double zclip_zscore(const ZClipState& e, const ZClipRule& rule, double g) {
  if (!rule.enabled || e.count < rule.warmup || !std::isfinite(g)) return nan_value();
  return (g - e.mean) / (std::sqrt(e.var) + 1e-6);
}

// The bound a norm `g` is clipped to (0: none).
LOCKSTEP_HD inline double zclip_bound(const ZClipState& e, const ZClipRule& rule, double g) {
  const double z = zclip_zscore(e, rule, g);
  if (!(z > rule.z)) return 0.0;
  return e.mean + rule.z * std::sqrt(e.var) / (z / rule.z);
}

LOCKSTEP_HD inline void zclip_record(ZClipState& e, const ZClipRule& rule, double g) {
  if (!rule.enabled || !std::isfinite(g)) return;
  if (e.count < rule.warmup) {
    ++e.count;
    const double d = g - e.mean;
    e.mean += d / static_cast<double>(e.count);
    e.m2 += d * (g - e.mean);
    if (e.count == rule.warmup) e.var = e.m2 / static_cast<double>(e.count);
    return;
  }
  e.mean = rule.alpha * e.mean + (1.0 - rule.alpha) * g;
  const double d = g - e.mean;
  e.var = rule.alpha * e.var + (1.0 - rule.alpha) * d * d;
}

}  // namespace lockstep::core
