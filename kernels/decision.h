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

// ---- the device's screen of a step (kernels/decision.cu) ----------------------------------------

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

// The detector's state a clean step advances, on the device.
struct ScreenState {
  Ring grad_norms, losses;
  LossScaleState scale;
  int64_t consecutive_skips;
  int64_t optimizer_steps;
};

struct ScreenConfig {
  Thresholds thresholds;
  int64_t min_history = 0;
  double max_norm = 0;  // training.max_norm: the clip
  LossScaleRule loss_scale;
};

// What the host reads a step later (pinned), and what the fused AdamW reads now (found_inf,
// grad_scale, on the device).
struct ScreenResult {
  double grad_norm, loss, grad_norm_z, loss_z, clip, loss_scale;
  uint32_t reasons;  // 0: clean, taken on the device; else held for the host's decision
  int32_t stop;      // a rank asked all to stop
  int32_t overflow;  // loss scaling on, a nonfinite gradient and every loss finite
};

// One step on the device: reduce, score against the windows, and either take it (clean: the
// update proceeds with grad_scale = loss scale / clip, the windows and counters advance) or
// hold it (found_inf = 1: nothing is updated until the host, reading `out`, decides it with
// scope and culprits). The host's SkipDetector computes the same numbers with the same code.
LOCKSTEP_HD inline void screen_step(const double* table, int world, ScreenState& s,
                                    const ScreenConfig& c, ScreenResult& out, float* found_inf,
                                    float* grad_scale) {
  const auto stat = [table](int i, int f) { return table[i * kStatsDoubles + f]; };
  const auto none = [](int) { return false; };
  const Global g = reduce_in_rank_order(stat, world, none);
  out.loss_scale = s.scale.scale;
  out.grad_norm = s.scale.scale != 1.0 ? g.grad_norm / s.scale.scale : g.grad_norm;
  out.loss = g.loss;
  out.overflow = c.loss_scale.enabled && g.nonfinite > 0 && !g.loss_nonfinite ? 1 : 0;
  const bool zscores = s.grad_norms.size >= c.min_history && !out.overflow;
  const auto gn = [&s](int64_t i) { return ring_at(s.grad_norms, i); };
  const auto ls = [&s](int64_t i) { return ring_at(s.losses, i); };
  out.grad_norm_z = zscores && std::isfinite(out.grad_norm)
                        ? window_zscore(gn, s.grad_norms.size, out.grad_norm)
                        : nan_value();
  out.loss_z = zscores && std::isfinite(out.loss) ? window_zscore(ls, s.losses.size, out.loss)
                                                  : nan_value();
  out.reasons = reasons_of(g, out.grad_norm, out.grad_norm_z, out.loss_z, c.thresholds);
  out.stop = g.stop ? 1 : 0;
  out.clip = out.reasons == 0 ? clip_coefficient(out.grad_norm, c.max_norm) : 1.0;
  *found_inf = out.reasons == 0 ? 0.0f : 1.0f;
  *grad_scale = static_cast<float>(out.loss_scale / out.clip);
  if (out.reasons != 0) return;
  ring_push(s.grad_norms, out.grad_norm);
  ring_push(s.losses, out.loss);
  s.consecutive_skips = 0;
  ++s.optimizer_steps;
  loss_scale_record(s.scale, c.loss_scale, false, true);
}

// screen_step as a one-thread kernel on `stream` (a cudaStream_t); every pointer is device
// memory, `state`'s rings included. Returns a cudaError_t as int (0 = launched). CUDA builds
// only (kernels/decision.cu).
int launch_screen_step(const double* table, int world, ScreenState* state,
                       const ScreenConfig& config, ScreenResult* out, float* found_inf,
                       float* grad_scale, void* stream);

}  // namespace lockstep::kernels
