// The numeric core of the step decision, framework-free and written once: the host decision
// (src/decide/detector.cpp and scope.cpp, the trainer's clip) calls these
// functions, and kernels/decision.cu runs the same ones as a kernel on the device, so the two
// cannot drift apart. It is what a step needs to be decided without the host: the global
// numbers reduced in rank order, the z-scores over the rolling windows (the global ones and each
// rank's own), the threshold reasons, the anomaly's scope (a minority of ranks, or most of
// them) and the policy it selects (skip, clip to the window's bound, abort), the clip
// coefficient, the guards' counts and the loss-scale update. Culprit names, causes and events
// stay on the host: only an anomalous step needs them, a step later.
//
// The host decides with these same functions over the same state (src/decide/detector.cpp holds
// a DecideState whose rings live in host memory and adds only names: reasons, culprits, causes,
// guard messages); what the host settled before the sync (triage: dropped ranks, replays, the
// probe) enters as a Settled input, which the device's decision leaves empty.
//
// Bit-for-bit agreement between host and device: the same operations in the same order, fp64
// throughout, one canonical NaN in every result, and no contraction into FMAs (decision.cu is
// compiled with --fmad=false, every host target with -ffp-contract=off: CMakeLists.txt).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__CUDACC__)
#define LOCKSTEP_HD __host__ __device__
#else
#define LOCKSTEP_HD
#endif

namespace lockstep::kernels {

// One rank's row of the exchanged stats table ([W, kStatsDoubles] doubles, rank order): the
// layout of lockstep::RankStats (include/lockstep/decision.h).
enum StatsField : int {
  kShardNonfinite = 0,
  kShardSumsq = 1,
  kLocalNonfinite = 2,
  kLocalSumsq = 3,
  kLoss = 4,
  kStopRequested = 5,  // 1: stop after this step; 2: a stop cut this rank's step short
  kOverflowRuns = 6,
  kBadSamples = 7,
  kComputeSeconds = 8,  // stragglers (diag/stragglers.h) and skip.max_consecutive_seconds
  kStatsDoubles = 9
};

LOCKSTEP_HD inline double nan_value() {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(0x7ff8000000000000LL);  // the host's quiet NaN, bit for bit
#else
  return std::numeric_limits<double>::quiet_NaN();
#endif
}
LOCKSTEP_HD inline double inf_value() {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(0x7ff0000000000000LL);
#else
  return std::numeric_limits<double>::infinity();
#endif
}
// The one NaN the core returns (a GPU may give an arithmetic NaN other bits than the CPU).
LOCKSTEP_HD inline double canonical(double v) { return v != v ? nan_value() : v; }

LOCKSTEP_HD inline double max_of(double a, double b) { return a < b ? b : a; }
LOCKSTEP_HD inline double min_of(double a, double b) { return b < a ? b : a; }

// ---- rolling windows: `n` values read by at(i), i = 0 the oldest, summed oldest first --------

template <class At>
LOCKSTEP_HD double window_mean(const At& at, int64_t n) {
  if (n == 0) return nan_value();
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += at(i);
  return s / static_cast<double>(n);
}

// Population standard deviation.
template <class At>
LOCKSTEP_HD double window_stddev(const At& at, int64_t n) {
  if (n == 0) return nan_value();
  const double m = window_mean(at, n);
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += (at(i) - m) * (at(i) - m);
  return std::sqrt(s / static_cast<double>(n));
}

// (v - mean) / std, with std floored at 1e-12 * |mean| so a flat window is not a hair trigger.
template <class At>
LOCKSTEP_HD double window_zscore(const At& at, int64_t n, double v) {
  const double m = window_mean(at, n);
  const double sd = max_of(window_stddev(at, n), 1e-12 * std::fabs(m));
  if (sd == 0) return v > m ? inf_value() : 0.0;
  return (v - m) / sd;
}

// ---- the global numbers -----------------------------------------------------------------------

// Never a partial norm as the norm: NaN when any element was nonfinite.
LOCKSTEP_HD inline double norm_of(double nonfinite, double sumsq) {
  return nonfinite > 0 ? nan_value() : std::sqrt(sumsq);
}

struct Global {
  double nonfinite = 0, sumsq = 0, overflow_runs = 0;
  double grad_norm = 0;  // of the gradient as synced (still times the loss scale)
  double loss = 0;       // the mean over the contributing ranks; NaN when none contributes
  bool stop = false, loss_nonfinite = false;
  bool interrupted = false;  // some rank's step was cut short by a stop: its gradient is partial
};

// Every rank adds the same numbers in the same order (rank order). `stat(i, f)`: field f of
// rank i's row; `dropped(i)`: rank i's contribution was dropped (its loss does not count).
template <class Stat, class Dropped>
LOCKSTEP_HD Global reduce_in_rank_order(const Stat& stat, int world, const Dropped& dropped) {
  Global g;
  double sumsq = 0, loss_sum = 0;
  int contributing = 0;
  for (int i = 0; i < world; ++i) {
    g.nonfinite += stat(i, kShardNonfinite);
    sumsq += stat(i, kShardSumsq);
    g.overflow_runs += stat(i, kOverflowRuns);
    g.stop = g.stop || stat(i, kStopRequested) != 0;
    g.interrupted = g.interrupted || stat(i, kStopRequested) >= 2;
    if (dropped(i)) continue;
    const double loss = stat(i, kLoss);
    loss_sum += loss;
    ++contributing;
    g.loss_nonfinite = g.loss_nonfinite || !std::isfinite(loss);
  }
  g.sumsq = sumsq;
  g.grad_norm = norm_of(g.nonfinite, sumsq);
  g.loss = contributing == 0 ? nan_value()
                             : canonical(loss_sum / static_cast<double>(contributing));
  return g;
}

// ---- thresholds -------------------------------------------------------------------------------

// Why a step is not clean, as bits, in the order the host names them.
enum Reason : uint32_t {
  kNonfiniteGrad = 1u << 0,
  kNonfiniteLoss = 1u << 1,
  kGradNormAboveMax = 1u << 2,
  kGradNormSpike = 1u << 3,
  kLossSpike = 1u << 4,
  kGradNormZClip = 1u << 5,  // above ZClip's EMA bound (skip.adaptive_clip = "zclip")
};
constexpr int kReasonCount = 6;

struct Thresholds {
  bool enabled = false;        // skip.enabled: the thresholds below apply
  double max_grad_norm = 0;    // 0 = off
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

// The factor the update is scaled by so the global norm is at most max_norm (1: no clip).
LOCKSTEP_HD inline double clip_coefficient(double total_norm, double max_norm) {
  if (max_norm <= 0 || !std::isfinite(total_norm)) return 1.0;
  return min_of(1.0, max_norm / (total_norm + 1e-6));
}

// The limit a taken step is clipped to: training.max_norm, or a clip decision's bound
// (`clip_to` > 0) when that is lower.
LOCKSTEP_HD inline double clip_limit(double clip_to, double max_norm) {
  return clip_to > 0 && (max_norm <= 0 || clip_to < max_norm) ? clip_to : max_norm;
}

// The largest value a window accepts, mean + z * std, once it holds min_history values; else v.
template <class At>
LOCKSTEP_HD double window_bounded(const At& at, int64_t n, double v, double z,
                                  int64_t min_history) {
  if (n < min_history || z <= 0 || !std::isfinite(v)) return v;
  return min_of(v, window_mean(at, n) + z * window_stddev(at, n));
}

// ---- scope: a minority of ranks, or most of them --------------------------------------------

// One rank's own values against its own windows: why it stands out (kNonfiniteGrad,
// kNonfiniteLoss, kGradNormSpike, kLossSpike), whether its own samples name themselves, and its
// z-scores (NaN while its windows hold fewer than min_history values). `row`: the rank's
// stats; `scale`: the loss scale its gradient carries; `gn`/`ls`: its windows.
struct RankFinding {
  uint32_t reasons = 0;
  bool samples = false;
  double grad_norm_z = 0, loss_z = 0;
};

// A rank's own values as its windows hold them: its gradient norm (unscaled: `scale` is the loss
// scale its gradient carries) and its loss.
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

// A local anomaly: some ranks stand out, at most half of them (or samples name themselves).
LOCKSTEP_HD inline bool is_local(int outliers, int world, bool sample_evidence) {
  return outliers > 0 && (sample_evidence || 2 * outliers <= world);
}

// Sorts v[0, n) ascending (a heap sort: one thread, no allocation).
LOCKSTEP_HD inline void sort_ascending(double* v, int n) {
  const auto sift = [v](int root, int end) {
    while (2 * root + 1 < end) {
      int child = 2 * root + 1;
      if (child + 1 < end && v[child] < v[child + 1]) ++child;
      if (!(v[root] < v[child])) return;
      const double t = v[root];
      v[root] = v[child];
      v[child] = t;
      root = child;
    }
  };
  for (int i = n / 2 - 1; i >= 0; --i) sift(i, n);
  for (int end = n - 1; end > 0; --end) {
    const double t = v[0];
    v[0] = v[end];
    v[end] = t;
    sift(0, end);
  }
}

// The median of the others' values (the ((n - 1) / 2)-th smallest of the n - 1 others) for the
// rank whose value is `v`, from all n values sorted.
LOCKSTEP_HD inline double median_of_others(const double* sorted, int n, double v) {
  int lo = 0, hi = n;  // the first position holding v: the one taken out
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (sorted[mid] < v) lo = mid + 1;
    else hi = mid;
  }
  const int k = (n - 1) / 2;
  return lo > k ? sorted[k] : sorted[k + 1];
}

// Before the windows fill (skip.max_grad_norm acts from the first step): the ranks whose own
// gradient norm exceeds 4x the median of the others' (squared: 16x). `flag(r)` is called for
// each, in rank order; returns how many. `scratch`: `world` doubles.
template <class Stat, class Flag>
LOCKSTEP_HD int cross_rank_outliers(const Stat& stat, int world, double* scratch,
                                    const Flag& flag) {
  if (world < 2) return 0;
  for (int i = 0; i < world; ++i) scratch[i] = stat(i, kLocalSumsq);
  sort_ascending(scratch, world);
  int n = 0;
  for (int r = 0; r < world; ++r) {
    const double v = stat(r, kLocalSumsq);
    if (!(v > 16.0 * median_of_others(scratch, world, v))) continue;
    flag(r);
    ++n;
  }
  return n;
}

// What skip.on_global_spike does with an anomaly on most ranks (a nonfinite one is skipped).
enum GlobalSpike : int32_t { kSpikeClip = 0, kSpikeSkip = 1, kSpikeAbort = 2 };

// A clip decision's bound: the largest global norm the detector accepts (the grad-norm window's
// mean + z * std, skip.max_grad_norm), 0 when neither applies.
template <class At>
LOCKSTEP_HD double spike_clip_to(uint32_t reasons, const At& gn, int64_t n, const Thresholds& t) {
  double to = inf_value();
  if (reasons & kGradNormSpike)
    to = min_of(to, window_mean(gn, n) + t.grad_norm_zscore * window_stddev(gn, n));
  if (reasons & kGradNormAboveMax) to = min_of(to, t.max_grad_norm);
  return std::isfinite(to) ? to : 0.0;
}

// ---- ZClip: an EMA of the global norm (skip.adaptive_clip = "zclip") ---------------------------
//
// ZClip's rule (arXiv 2504.02507; its constants are the config's defaults): the first `warmup`
// taken steps' norms give the mean and the (population) variance; after them each taken step
// moves mean = a * mean + (1 - a) * g, var = a * var + (1 - a) * (g - mean)^2 with the norm g as
// taken (clipped: the bound). A norm with z = (g - mean) / (std + 1e-6) above z_t is clipped to
// mean + z_t * std / (z / z_t). Unlike ZClip's reference code its state is checkpointed, it is
// agreed by construction, and a nonfinite norm never enters it (only taken steps do).

struct ZClipRule {
  int32_t enabled = 0;
  double alpha = 0.97, z = 2.5;
  int64_t warmup = 25;
};

struct ZClipState {
  int64_t count;  // norms taken in, up to warmup (then it stays there)
  double mean, m2, var;  // m2: the warm-up's running sum of squared deviations (Welford)
};

// The z-score of `g` against the EMA, NaN while warming up, off, or for a nonfinite norm.
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

// A taken step's norm (as taken) enters the statistics.
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

// ---- per tensor: AdaGC's clip and SPAM's moment reset (skip.adaptive_clip = "adagc",
//      skip.spike_moment_reset) -----------------------------------------------------------------
//
// AdaGC's rule (arXiv 2502.11034; its constants are the config's defaults): each tensor i keeps
// a threshold gamma_i. During the first `warmup` taken steps the global clip (training.max_norm)
// acts alone and gamma_i tracks the minimum of the tensor's norms as taken; after them a tensor
// whose norm n_i exceeds lambda * gamma_i is scaled down to that bound, and gamma_i = beta *
// gamma_i + (1 - beta) * (its norm as taken). The norms are those of the update the global
// decision takes (unscaled, after its clip); only taken steps move gamma, and a nonfinite norm
// never does. The same thresholds name the tensors a global spike hit (SPAM's idea, arXiv
// 2501.06842: their AdamW moments are reset). Every rank holds every rank's per-tensor partial
// sums (one more small all-gather) and adds them in rank order: the same factors everywhere.

struct TensorRule {
  int32_t clip = 0;   // skip.adaptive_clip = "adagc": scale the tensors above their bound down
  int32_t reset = 0;  // skip.spike_moment_reset: reset the moments of the tensors a spike hit
  double lambda = 1.05, beta = 0.98;
  int64_t warmup = 100;
};

// Tensor i's global sum of squares from the [world, tensors] table of partial sums.
LOCKSTEP_HD inline double tensor_sumsq(const double* table, int world, int tensors, int i) {
  double s = 0;
  for (int r = 0; r < world; ++r) s += table[r * tensors + i];
  return s;
}

// The factor tensor i's update is scaled by (1: none); `count`: taken steps seen so far;
// `norm`: the tensor's norm as the global decision takes it.
LOCKSTEP_HD inline double tensor_clip_factor(const TensorRule& r, int64_t count, double gamma,
                                             double norm) {
  if (!r.clip || count < r.warmup || !std::isfinite(norm) || !(norm > r.lambda * gamma))
    return 1.0;
  return r.lambda * gamma / norm;
}

// Tensor i's threshold after a taken step whose norm as taken (factor applied) is `taken`.
LOCKSTEP_HD inline double tensor_threshold_after(const TensorRule& r, int64_t count, double gamma,
                                                 double taken) {
  if (!std::isfinite(taken)) return gamma;
  if (count == 0) return taken;
  if (count < r.warmup) return min_of(gamma, taken);
  return r.beta * gamma + (1.0 - r.beta) * taken;
}

// Whether tensor i's norm (unscaled, before any clip) stands above its bound: a global spike
// hit it.
LOCKSTEP_HD inline bool tensor_spiked(const TensorRule& r, int64_t count, double gamma,
                                      double norm) {
  return count > 0 && std::isfinite(norm) && norm > r.lambda * gamma;
}

// ---- guards -----------------------------------------------------------------------------------

enum Guard : int { kNoGuard = 0, kMaxConsecutive = 1, kMaxFraction = 2, kMaxSeconds = 3 };

// The guard a skip now would trip. `recent_skips` of the last `recent` decisions (at most
// fraction_window; `oldest_skipped`: the oldest of them was a skip); `*skips_in_window` gets
// the skips the window would hold with this one. `skip_seconds`: the compute seconds the skips
// in a row would have cost with this one, against max_seconds (skip.max_consecutive_seconds;
// 0 = off).
LOCKSTEP_HD inline Guard guard_tripped(int64_t consecutive, int64_t max_consecutive,
                                       int64_t recent_skips, int64_t recent, bool oldest_skipped,
                                       double max_fraction, int64_t fraction_window,
                                       double skip_seconds, double max_seconds,
                                       int64_t* skips_in_window) {
  if (max_consecutive > 0 && consecutive + 1 > max_consecutive) return kMaxConsecutive;
  if (max_seconds > 0 && skip_seconds > max_seconds) return kMaxSeconds;
  if (max_fraction <= 0) return kNoGuard;
  int64_t skips = recent_skips + 1;
  if (recent == fraction_window && oldest_skipped) --skips;
  *skips_in_window = skips;
  return static_cast<double>(skips) > max_fraction * static_cast<double>(fraction_window)
             ? kMaxFraction
             : kNoGuard;
}

// ---- loss scaling -----------------------------------------------------------------------------

struct LossScaleState {
  double scale = 1;
  int64_t growth_tracker = 0;
  int64_t consecutive_overflows = 0;
};

struct LossScaleRule {
  bool enabled = false;  // any loss scaling (static or dynamic): a nonfinite gradient with every
                         // loss finite is an overflow
  bool dynamic = false;
  double growth_factor = 2, backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

// The agreed step's effect: an overflow backs off; `updated` clean updates grow the scale
// every growth_interval.
LOCKSTEP_HD inline void loss_scale_record(LossScaleState& s, const LossScaleRule& rule,
                                          bool overflow, bool updated) {
  if (overflow) {
    ++s.consecutive_overflows;
    s.growth_tracker = 0;
    if (rule.dynamic) s.scale *= rule.backoff_factor;
    return;
  }
  if (!updated) return;
  s.consecutive_overflows = 0;
  if (!rule.dynamic) return;
  if (++s.growth_tracker == rule.growth_interval) {
    s.scale *= rule.growth_factor;
    s.growth_tracker = 0;
  }
}

// ---- loss-scale guards ------------------------------------------------------------------------

enum ScaleGuard : int { kNoScaleGuard = 0, kMaxOverflows = 1, kScaleMin = 2 };

// The guard an overflow now would trip (it becomes an abort).
LOCKSTEP_HD inline ScaleGuard scale_guard(const LossScaleState& s, const LossScaleRule& rule,
                                          int64_t max_overflows, double min_scale) {
  if (max_overflows > 0 && s.consecutive_overflows + 1 > max_overflows) return kMaxOverflows;
  if (rule.dynamic && s.scale * rule.backoff_factor < min_scale) return kScaleMin;
  return kNoScaleGuard;
}

// ---- the whole decision of a step (the host's and the device's) ------------------------------

// A rolling window: `values[(head + i) % capacity]`, i = 0 the oldest.
struct Ring {
  double* values;
  int64_t capacity;
  int64_t head;
  int64_t size;
};

// 0 <= i < capacity and 0 <= head < capacity: one subtraction, no division (windows are read
// value by value, every rank's on an anomalous step).
LOCKSTEP_HD inline double ring_at(const Ring& r, int64_t i) {
  const int64_t j = r.head + i;
  return r.values[j < r.capacity ? j : j - r.capacity];
}

LOCKSTEP_HD inline void ring_push(Ring& r, double v) {
  if (r.size < r.capacity) {
    r.values[(r.head + r.size) % r.capacity] = v;
    ++r.size;
  } else {
    r.values[r.head] = v;
    r.head = (r.head + 1) % r.capacity;
  }
}

// Every rank's own windows in one block of doubles: window i = 2r (rank r's gradient norms)
// or 2r + 1 (its losses) keeps its head and size (integers, exact as doubles) at meta[2i] and
// meta[2i + 1] and its values at values[i * capacity, (i + 1) * capacity).
struct RankWindows {
  double* meta;
  double* values;
  int64_t capacity;
};

LOCKSTEP_HD inline Ring rank_ring(const RankWindows& w, int rank, int k) {
  const int64_t i = 2 * rank + k;
  return {w.values + i * w.capacity, w.capacity, static_cast<int64_t>(w.meta[2 * i]),
          static_cast<int64_t>(w.meta[2 * i + 1])};
}

LOCKSTEP_HD inline void rank_ring_push(const RankWindows& w, int rank, int k, double v) {
  Ring r = rank_ring(w, rank, k);
  ring_push(r, v);
  const int64_t i = 2 * rank + k;
  w.meta[2 * i] = static_cast<double>(r.head);
  w.meta[2 * i + 1] = static_cast<double>(r.size);
}

// Everything a decision reads and advances (host or device memory): the global windows, each
// rank's own, the last fraction_window decisions (1 = skipped), the skip guards' count, the loss
// scale and the sticky abort. The run's counters (steps, skips, clips) are the trainer's.
struct DecideState {
  Ring grad_norms, losses;
  Ring recent;  // 0 / 1 per decision, oldest first; recent_skips = their sum
  RankWindows ranks;
  double* scratch;  // `world` doubles: the cross-rank median's sort
  int64_t recent_skips;
  LossScaleState scale;
  int64_t consecutive_skips;
  double consecutive_skip_seconds;  // the compute seconds (slowest rank's) those skips cost
  ZClipState zclip;
  int32_t aborted;  // once set, every later decision is an abort: no update lands after it
};

// A decision enters the last fraction_window (1 = skipped), its skip count kept with it.
LOCKSTEP_HD inline void recent_push(DecideState& s, bool skipped) {
  if (s.recent.capacity == 0) return;
  if (s.recent.size == s.recent.capacity) s.recent_skips -= ring_at(s.recent, 0) != 0 ? 1 : 0;
  ring_push(s.recent, skipped ? 1.0 : 0.0);
  s.recent_skips += skipped ? 1 : 0;
}

// The doubles a DecideState's rings take: both global windows, the recent decisions, then each
// rank's two windows (4 meta doubles and 2 windows per rank) and the scratch.
inline int64_t decide_state_doubles(int64_t window, int64_t fraction_window, int world) {
  return 2 * window + fraction_window + world * (4 + 2 * window + 1);
}

// A fresh state whose rings live in `rings` (decide_state_doubles of them, zero-filled, host or
// device memory): empty windows, no decisions yet, loss scale `scale`.
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

// The same state with its rings moved from `from` to `to` (a copy of the same block: the host's
// rings uploaded to the device in one copy).
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
  int32_t on_global_spike = kSpikeSkip;  // GlobalSpike
  int32_t hardware_abort = 0;            // skip.on_hardware_fault = "abort"
  ZClipRule zclip;
};

// What the host settled before the sync (skip.scope = "rank", skip.replay, the probe: triage.cpp);
// the device's decision has none of it.
struct Settled {
  const uint8_t* dropped;  // per rank (nullptr: none): its contribution was dropped (zeros synced)
  int32_t culprits;        // local culprits named before the sync
  int32_t skip_step;       // their gradients stay bad and cannot all be dropped
  int32_t suspects;        // devices a replay or the probe blamed
};

enum Outcome : int32_t { kTake = 0, kSkipStep = 1, kAbortRun = 2 };
// Why an abort: a skip guard (Guard), a loss-scale guard (10 + ScaleGuard), skip.enabled =
// false, an earlier abort, skip.on_global_spike = "abort" or skip.on_hardware_fault = "abort".
enum AbortWhy : int32_t {
  kNotAborted = 0,
  kSkipDisabled = 20,
  kStickyAbort = 21,
  kGlobalSpikeAbort = 22,
  kHardwareFaultAbort = 23,
  kInterrupted = 24  // not an abort: a skip of a step a stop cut short (the run then stops)
};

// What the host reads a step later (pinned); found_inf and grad_scale go to the fused AdamW
// now, on the device.
struct DecideResult {
  double grad_norm, loss, grad_norm_z, loss_z, clip, loss_scale;
  double nonfinite, overflow_runs;  // the global counts: nonfinite elements, fp32-overflowed runs
  double clip_to;     // a clip decision's bound (0: none)
  double seconds;     // the slowest rank's compute seconds (the table's kComputeSeconds)
  uint32_t reasons;   // kNonfiniteGrad, ... (an overflow: kNonfiniteGrad with `overflow`)
  int32_t outcome;    // Outcome
  int32_t why;        // Guard, 10 + ScaleGuard, or AbortWhy
  int32_t overflow;   // loss scaling on, a nonfinite gradient and every loss finite
  int32_t clipped;    // taken, clipped: a global spike with skip.on_global_spike = "clip"
  int32_t salvaged;   // taken without the dropped ranks' contributions
  int32_t stop;       // a rank asked all to stop
  int32_t interrupted;  // a rank's step was cut short by a stop: nothing of it lands
  int64_t skips_in_window;  // for the max_fraction guard's message
};

// Whether an anomaly with global `reasons` is on most ranks: from each rank's own values
// against its own windows, and, when none stands out and the norm is the reason, from the
// ranks' norms against each other's (writes s.scratch).
LOCKSTEP_HD inline bool is_global(const double* table, int world, const DecideState& s,
                                  const DecideConfig& c, uint32_t reasons) {
  int outliers = 0;
  bool samples = false;
  for (int r = 0; r < world; ++r) {
    const Ring g = rank_ring(s.ranks, r, 0), l = rank_ring(s.ranks, r, 1);
    const auto gn = [&g](int64_t i) { return ring_at(g, i); };
    const auto ls = [&l](int64_t i) { return ring_at(l, i); };
    const RankFinding f = rank_finding(table + r * kStatsDoubles, s.scale.scale, gn, g.size, ls,
                                       l.size, c.min_history, c.thresholds);
    samples = samples || f.samples;
    outliers += f.reasons != 0 ? 1 : 0;
  }
  if (outliers > 0 || !(reasons & (kGradNormAboveMax | kGradNormSpike | kGradNormZClip)))
    return !is_local(outliers, world, samples);
  const auto stat = [table](int i, int f) { return table[i * kStatsDoubles + f]; };
  const int n = cross_rank_outliers(stat, world, s.scratch, [](int) {});
  return !(n > 0 && 2 * n <= world);
}

// The outcome of an anomalous step (not an overflow) under the policy: skipped (or aborted by a
// guard), or, for a global spike, clipped or aborted as skip.on_global_spike says. Culprits
// named before the sync make the anomaly local.
LOCKSTEP_HD inline void apply_policy(const double* table, int world, const DecideState& s,
                                     const DecideConfig& c, bool settled_local,
                                     DecideResult& out) {
  const bool nonfinite = (out.reasons & (kNonfiniteGrad | kNonfiniteLoss)) != 0;
  const bool zclip_only = out.reasons == kGradNormZClip;  // ZClip clips, never skips
  if ((zclip_only || c.on_global_spike != kSpikeSkip) && !nonfinite && !settled_local &&
      is_global(table, world, s, c, out.reasons)) {
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
  const Guard guard = guard_tripped(s.consecutive_skips, c.max_consecutive, s.recent_skips,
                                    s.recent.size, oldest, c.max_fraction, c.fraction_window,
                                    s.consecutive_skip_seconds + out.seconds,
                                    c.max_consecutive_seconds, &out.skips_in_window);
  out.outcome = guard == kNoGuard ? kSkipStep : kAbortRun;
  out.why = guard;
}

// The global numbers of a step: reduced in rank order (without the dropped ranks' losses),
// unscaled, with their z-scores and the threshold reasons.
LOCKSTEP_HD inline void score_numbers(const double* table, int world, const DecideState& s,
                                      const DecideConfig& c, const Settled& settled,
                                      DecideResult& out) {
  const auto stat = [table](int i, int f) { return table[i * kStatsDoubles + f]; };
  const auto dropped = [&settled](int i) { return settled.dropped && settled.dropped[i] != 0; };
  const Global g = reduce_in_rank_order(stat, world, dropped);
  out = DecideResult{};
  out.loss_scale = s.scale.scale;
  out.grad_norm = canonical(s.scale.scale != 1.0 ? g.grad_norm / s.scale.scale : g.grad_norm);
  out.loss = g.loss;
  out.stop = g.stop ? 1 : 0;
  out.interrupted = g.interrupted ? 1 : 0;
  out.nonfinite = g.nonfinite;
  out.overflow_runs = g.overflow_runs;
  out.clip = 1.0;
  out.overflow =
      c.loss_scale.enabled && g.nonfinite > 0 && !g.loss_nonfinite && settled.culprits == 0;
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
  for (int i = 0; i < world; ++i) {
    out.salvaged |= dropped(i) ? 1 : 0;
    out.seconds = max_of(out.seconds, stat(i, kComputeSeconds));
  }
}

// The numbers and the outcome of one step; `s` is not changed (but for its scratch).
LOCKSTEP_HD inline void score_step(const double* table, int world, const DecideState& s,
                                   const DecideConfig& c, const Settled& settled,
                                   DecideResult& out) {
  score_numbers(table, world, s, c, settled, out);
  if (out.interrupted) {  // a partial gradient: not an update, not a skip to count
    out.outcome = kSkipStep;
    out.why = kInterrupted;
    out.overflow = out.salvaged = 0;
    return;
  }
  if (out.overflow) {  // the loss scale, not the data: skipped, backed off, its own guards
    const ScaleGuard sg = scale_guard(s.scale, c.loss_scale, c.loss_scale_max_overflows,
                                      c.loss_scale_min);
    out.outcome = sg == kNoScaleGuard ? kSkipStep : kAbortRun;
    out.why = sg == kNoScaleGuard ? kNotAborted : 10 + sg;
    out.salvaged = 0;
    return;
  }
  if (out.reasons != 0 || settled.skip_step) {
    out.salvaged = 0;
    if (!c.thresholds.enabled) {  // stock behaviour: a nonfinite value stops the job
      out.outcome = kAbortRun;
      out.why = kSkipDisabled;
      return;
    }
    apply_policy(table, world, s, c, settled.culprits > 0, out);
  }
  if (out.outcome != kAbortRun && settled.suspects > 0 && c.hardware_abort) {
    out.outcome = kAbortRun;
    out.why = kHardwareFaultAbort;
    out.clipped = out.salvaged = 0;
    return;
  }
  if (out.outcome == kTake)
    out.clip = clip_coefficient(out.grad_norm, clip_limit(out.clip_to, c.max_norm));
}

// The decided step's effect on the global state: an abort sets the sticky flag and changes
// nothing else (so does an interrupted step: the run stops, no later update may land); an
// overflow backs the loss scale off; a skip counts toward the guards; a taken step (clipped:
// bounded to the windows' limits) enters the windows.
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

// A taken step's effect on rank `rank`'s own windows (each rank is independent: the device
// records them in parallel): its values `v` enter, bounded on a clip.
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
                                    const DecideResult& r, const Settled& settled, int rank) {
  if (settled.dropped && settled.dropped[rank] != 0) return;
  record_rank_values(s, c, r, rank, rank_values(table + rank * kStatsDoubles, r.loss_scale));
}

// One step's decision and its effect on the global state (the device runs it on one thread,
// then record_rank on one thread per rank): STEP, SKIP, CLIP or ABORT from the exchanged table
// and the state, with nothing settled before the sync: found_inf = 1 blocks the fused AdamW on
// a skip or an abort (and on every step after an abort), grad_scale = loss scale / clip.
LOCKSTEP_HD inline void decide_global(const double* table, int world, DecideState& s,
                                      const DecideConfig& c, DecideResult& out, float* found_inf,
                                      float* grad_scale) {
  if (s.aborted) {
    out = DecideResult{};
    out.outcome = kAbortRun;
    out.why = kStickyAbort;
    out.clip = 1.0;
    out.loss_scale = s.scale.scale;
    *found_inf = 1.0f;
    *grad_scale = 1.0f;
    return;
  }
  score_step(table, world, s, c, Settled{}, out);
  *found_inf = out.outcome == kTake ? 0.0f : 1.0f;
  *grad_scale = static_cast<float>(out.loss_scale / out.clip);
  record_step(s, c, out);
}

// The whole step on one thread (the host's form of the device's kernel).
LOCKSTEP_HD inline void decide_step(const double* table, int world, DecideState& s,
                                    const DecideConfig& c, DecideResult& out, float* found_inf,
                                    float* grad_scale) {
  decide_global(table, world, s, c, out, found_inf, grad_scale);
  for (int r = 0; r < world; ++r) record_rank(s, c, table, out, Settled{}, r);
}

// ---- per tensor, on a decided step ------------------------------------------------------------
//
// The per-tensor policies (TensorRule above) act once the global decision is taken, from every
// rank's per-tensor partial sums of squares ([W, tensors] doubles, each rank's check [B] of its
// part of the synced gradient, added in rank order). The host runs them from its verdict
// (src/decide/tensor_policies.cpp), the device from the DecideResult its decision just wrote
// (launch_decide_tensors): the same functions, the same bits.

// Whether the decided step `r` is a global spike (`global`: the anomaly's scope is most ranks)
// that the policy skipped or clipped; not a nonfinite value, not an overflow. SPAM's reset acts
// on the tensors it hit.
LOCKSTEP_HD inline bool global_spike(const DecideResult& r, bool global) {
  constexpr uint32_t spikes = kGradNormAboveMax | kGradNormSpike | kLossSpike | kGradNormZClip;
  if (!global || r.overflow || r.interrupted || (r.reasons & (kNonfiniteGrad | kNonfiniteLoss)) ||
      !(r.reasons & spikes))
    return false;
  return r.outcome == kSkipStep || r.clipped;
}

// The same where there is no verdict's scope (the device): a clipped spike is global by
// construction (apply_policy), a skipped one when is_global says so; a skip leaves the rank
// windows and the loss scale as they were, so the state after record_step serves.
LOCKSTEP_HD inline bool global_spike(const double* table, int world, const DecideState& s,
                                     const DecideConfig& c, const DecideResult& r) {
  return global_spike(r, true) && (r.clipped || is_global(table, world, s, c, r.reasons));
}

// Tensor i's global norm (unscaled) from the [world, tensors] partial sums.
LOCKSTEP_HD inline double tensor_norm(const double* sums, int world, int tensors, int i,
                                      double loss_scale) {
  return std::sqrt(tensor_sumsq(sums, world, tensors, i)) / loss_scale;
}

struct TensorAction {
  double factor;  // its gradient x this before the update (1: not clipped)
  bool reset;     // its AdamW moments zeroed (their step counts kept)
};

// Tensor i's part of the decided step `r`: `norm` its global norm (unscaled, before any clip),
// `taken` the taken steps seen before this one, `spike` global_spike's answer. Its threshold
// `gamma` advances on a taken step, with the norm as taken (the global clip and its own).
LOCKSTEP_HD inline TensorAction decide_tensor(const TensorRule& rule, int64_t taken,
                                              double& gamma, double norm, const DecideResult& r,
                                              bool spike) {
  TensorAction a{1.0, rule.reset != 0 && spike && tensor_spiked(rule, taken, gamma, norm)};
  if (r.outcome != kTake || r.overflow) return a;
  const double as_taken = norm * r.clip;
  a.factor = tensor_clip_factor(rule, taken, gamma, as_taken);
  gamma = tensor_threshold_after(rule, taken, gamma, as_taken * a.factor);
  return a;
}

// Whether the decided step counts as taken for the per-tensor warm-up.
LOCKSTEP_HD inline bool tensor_step_taken(const DecideResult& r) {
  return r.outcome == kTake && !r.overflow;
}

// Every tensor's part on one thread (the host's form of the device's kernel): `factors` and
// `resets` (1: reset) per tensor in fp32, as the update reads them; `taken` advanced.
LOCKSTEP_HD inline void decide_tensors(const double* table, int world, const double* sums,
                                       int tensors, const DecideState& s, const DecideConfig& c,
                                       const TensorRule& rule, const DecideResult& r,
                                       int64_t& taken, double* gamma, float* factors,
                                       float* resets) {
  const bool spike = rule.reset != 0 && global_spike(table, world, s, c, r);
  for (int i = 0; i < tensors; ++i) {
    const TensorAction a = decide_tensor(rule, taken, gamma[i],
                                         tensor_norm(sums, world, tensors, i, r.loss_scale), r,
                                         spike);
    factors[i] = static_cast<float>(a.factor);
    resets[i] = a.reset ? 1.0f : 0.0f;
  }
  if (tensor_step_taken(r)) ++taken;
}

// decide_step as a kernel on `stream` (a cudaStream_t): decide_global on one thread, then
// record_rank on one thread per rank; every pointer is device memory, `state`'s rings
// included. Returns a cudaError_t as int (0 = launched). CUDA builds only (kernels/decision.cu).
int launch_decide_step(const double* table, int world, DecideState* state,
                       const DecideConfig& config, DecideResult* out, float* found_inf,
                       float* grad_scale, void* stream);

// decide_tensors as a kernel on `stream`, after launch_decide_step wrote `result`: one thread per
// tensor. Device memory throughout; `taken` one int64. Returns a cudaError_t as int.
int launch_decide_tensors(const double* table, int world, const double* sums, int tensors,
                          DecideState* state, const DecideConfig& config, const TensorRule& rule,
                          const DecideResult* result, int64_t* taken, double* gamma,
                          float* factors, float* resets, void* stream);

}  // namespace lockstep::kernels
