// The numeric core of the step decision, framework-free and written once: the host decision
// (src/decide/detector.cpp, loss_scale.cpp, optim/adamw.cpp's clip) calls these functions, and
// kernels/decision.cu runs the same ones as a one-thread kernel on the device, so the two cannot
// drift apart. It is what a step needs to be decided without the host when nothing is wrong:
// the global numbers reduced in rank order, the z-scores over the rolling windows, the
// threshold reasons, the clip coefficient, the guards' counts and the loss-scale update. Scope,
// culprits, causes and events stay on the host: only an anomalous step needs them.
//
// Bit-for-bit agreement between host and device: the same operations in the same order, fp64
// throughout, and no contraction into FMAs (decision.cu is compiled with --fmad=false; the host
// build targets x86-64 without FMA).
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
  kStopRequested = 5,
  kOverflowRuns = 6,
  kBadSamples = 7,
  kStatsDoubles = 8
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
    if (dropped(i)) continue;
    const double loss = stat(i, kLoss);
    loss_sum += loss;
    ++contributing;
    g.loss_nonfinite = g.loss_nonfinite || !std::isfinite(loss);
  }
  g.sumsq = sumsq;
  g.grad_norm = norm_of(g.nonfinite, sumsq);
  g.loss = contributing == 0 ? nan_value() : loss_sum / static_cast<double>(contributing);
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
};
constexpr int kReasonCount = 5;

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

// ---- guards -----------------------------------------------------------------------------------

enum Guard : int { kNoGuard = 0, kMaxConsecutive = 1, kMaxFraction = 2 };

// The guard a skip now would trip. `recent_skips` of the last `recent` decisions (at most
// fraction_window; `oldest_skipped`: the oldest of them was a skip); `*skips_in_window` gets
// the skips the window would hold with this one.
LOCKSTEP_HD inline Guard guard_tripped(int64_t consecutive, int64_t max_consecutive,
                                       int64_t recent_skips, int64_t recent, bool oldest_skipped,
                                       double max_fraction, int64_t fraction_window,
                                       int64_t* skips_in_window) {
  if (max_consecutive > 0 && consecutive + 1 > max_consecutive) return kMaxConsecutive;
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

// ---- the whole decision of a step on the device (kernels/decision.cu) -------------------------

// A rolling window in device memory: `values[(head + i) % capacity]`, i = 0 the oldest.
struct Ring {
  double* values;
  int64_t capacity;
  int64_t head;
  int64_t size;
};

LOCKSTEP_HD inline double ring_at(const Ring& r, int64_t i) {
  return r.values[(r.head + i) % r.capacity];
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

// Everything a decision reads and advances, in device memory: the global windows, the last
// fraction_window decisions (1 = skipped), the loss scale, the run's counters and the sticky
// abort.
struct DecideState {
  Ring grad_norms, losses;
  Ring recent;  // 0 / 1 per decision, oldest first; recent_skips = their sum
  int64_t recent_skips;
  LossScaleState scale;
  int64_t consecutive_skips, optimizer_steps, skipped_steps, overflow_skips;
  int32_t aborted;  // once set, every later decision is an abort: no update lands after it
};

// The doubles a DecideState's rings take: both windows, then the recent decisions.
inline int64_t decide_state_doubles(int64_t window, int64_t fraction_window) {
  return 2 * window + fraction_window;
}

// A fresh state whose rings live in `rings` (decide_state_doubles of them, host or device
// memory): empty windows, no decisions yet, loss scale `scale`.
inline DecideState fresh_decide_state(double* rings, int64_t window, int64_t fraction_window,
                                      double scale) {
  DecideState s{};
  s.grad_norms = {rings, window, 0, 0};
  s.losses = {rings + window, window, 0, 0};
  s.recent = {rings + 2 * window, fraction_window, 0, 0};
  s.scale.scale = scale;
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
  double max_fraction = 0;
  int64_t fraction_window = 0;
};

enum Outcome : int32_t { kTake = 0, kSkipStep = 1, kAbortRun = 2 };
// Why an abort: a skip guard (Guard), a loss-scale guard (10 + ScaleGuard), skip.enabled =
// false, or an earlier abort.
enum AbortWhy : int32_t { kNotAborted = 0, kSkipDisabled = 20, kStickyAbort = 21 };

// What the host reads a step later (pinned); found_inf and grad_scale go to the fused AdamW
// now, on the device.
struct DecideResult {
  double grad_norm, loss, grad_norm_z, loss_z, clip, loss_scale;
  uint32_t reasons;   // kNonfiniteGrad, ... (an overflow: kNonfiniteGrad with `overflow`)
  int32_t outcome;    // Outcome
  int32_t why;        // Guard, 10 + ScaleGuard, or AbortWhy
  int32_t overflow;   // loss scaling on, a nonfinite gradient and every loss finite
  int32_t stop;       // a rank asked all to stop
  int64_t skips_in_window;  // for the max_fraction guard's message
};

// The numbers and the outcome of one step; `s` is not changed.
LOCKSTEP_HD inline void score_step(const double* table, int world, const DecideState& s,
                                   const DecideConfig& c, DecideResult& out) {
  const auto stat = [table](int i, int f) { return table[i * kStatsDoubles + f]; };
  const auto none = [](int) { return false; };
  const Global g = reduce_in_rank_order(stat, world, none);
  out.loss_scale = s.scale.scale;
  out.grad_norm = s.scale.scale != 1.0 ? g.grad_norm / s.scale.scale : g.grad_norm;
  out.loss = g.loss;
  out.stop = g.stop ? 1 : 0;
  out.overflow = c.loss_scale.enabled && g.nonfinite > 0 && !g.loss_nonfinite ? 1 : 0;
  out.why = kNotAborted;
  out.skips_in_window = 0;
  const bool zscores = s.grad_norms.size >= c.min_history && !out.overflow;
  const auto gn = [&s](int64_t i) { return ring_at(s.grad_norms, i); };
  const auto ls = [&s](int64_t i) { return ring_at(s.losses, i); };
  out.grad_norm_z = zscores && std::isfinite(out.grad_norm)
                        ? window_zscore(gn, s.grad_norms.size, out.grad_norm)
                        : nan_value();
  out.loss_z = zscores && std::isfinite(out.loss) ? window_zscore(ls, s.losses.size, out.loss)
                                                  : nan_value();
  out.reasons = reasons_of(g, out.grad_norm, out.grad_norm_z, out.loss_z, c.thresholds);
  if (out.overflow) {  // the loss scale, not the data: skipped, backed off, its own guards
    const ScaleGuard sg = scale_guard(s.scale, c.loss_scale, c.loss_scale_max_overflows,
                                      c.loss_scale_min);
    out.outcome = sg == kNoScaleGuard ? kSkipStep : kAbortRun;
    out.why = sg == kNoScaleGuard ? kNotAborted : 10 + sg;
  } else if (out.reasons == 0) {
    out.outcome = kTake;
  } else if (!c.thresholds.enabled) {
    out.outcome = kAbortRun;
    out.why = kSkipDisabled;
  } else {
    const bool oldest = s.recent.size > 0 && ring_at(s.recent, 0) != 0;
    const Guard guard =
        guard_tripped(s.consecutive_skips, c.max_consecutive, s.recent_skips, s.recent.size,
                      oldest, c.max_fraction, c.fraction_window, &out.skips_in_window);
    out.outcome = guard == kNoGuard ? kSkipStep : kAbortRun;
    out.why = guard;
  }
  out.clip = out.outcome == kTake ? clip_coefficient(out.grad_norm, c.max_norm) : 1.0;
}

// The decided step's effect on the state (as the host's SkipDetector::record, LossScaler::record
// and the trainer's counters): an abort sets the sticky flag and changes nothing else.
LOCKSTEP_HD inline void record_step(DecideState& s, const DecideConfig& c,
                                    const DecideResult& r) {
  if (r.outcome == kAbortRun) {
    s.aborted = 1;
    return;
  }
  if (r.overflow) {
    loss_scale_record(s.scale, c.loss_scale, true, false);
    ++s.overflow_skips;
    return;
  }
  const bool skipped = r.outcome == kSkipStep;
  if (skipped) {
    ++s.consecutive_skips;
    ++s.skipped_steps;
  } else {
    s.consecutive_skips = 0;
    ring_push(s.grad_norms, r.grad_norm);
    ring_push(s.losses, r.loss);
    ++s.optimizer_steps;
  }
  if (s.recent.capacity > 0) {
    if (s.recent.size == s.recent.capacity) s.recent_skips -= ring_at(s.recent, 0) != 0 ? 1 : 0;
    ring_push(s.recent, skipped ? 1.0 : 0.0);
    s.recent_skips += skipped ? 1 : 0;
  }
  loss_scale_record(s.scale, c.loss_scale, false, !skipped);
}

// One step on the device: STEP, SKIP or ABORT from the exchanged table and the state, as the
// host decides it with skip.on_global_spike = "skip" and nothing settled before the sync (no
// salvage, no replay): found_inf = 1 blocks the fused AdamW on a skip or an abort (and on
// every step after an abort), grad_scale = loss scale / clip.
LOCKSTEP_HD inline void decide_step(const double* table, int world, DecideState& s,
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
  score_step(table, world, s, c, out);
  *found_inf = out.outcome == kTake ? 0.0f : 1.0f;
  *grad_scale = static_cast<float>(out.loss_scale / out.clip);
  record_step(s, c, out);
}

// decide_step as a one-thread kernel on `stream` (a cudaStream_t); every pointer is device
// memory, `state`'s rings included. Returns a cudaError_t as int (0 = launched). CUDA builds
// only (kernels/decision.cu).
int launch_decide_step(const double* table, int world, DecideState* state,
                       const DecideConfig& config, DecideResult* out, float* found_inf,
                       float* grad_scale, void* stream);

}  // namespace lockstep::kernels
