// What stops a run from skipping forever, and the fp16 loss scale: the skip guards (in a row, in
// compute seconds, as a fraction of recent steps), the loss scale's growth and back-off and its
// own guards, and the one list of why a step is an abort.
#pragma once

#include <cstdint>

#include "decide/core/windows.h"

namespace lockstep::core {

// Why a step is an abort (or, kInterrupted, a skip that ends the run); the values are the
// device's result's, so they stay as they are.
enum Why : int32_t {
  kNoWhy = 0,
  kMaxConsecutive = 1,  // skip guards
  kMaxFraction = 2,
  kMaxSeconds = 3,
  kMaxOverflows = 11,  // loss-scale guards
  kScaleMin = 12,
  kSkipDisabled = 20,        // skip.enabled = false: a nonfinite value stops the job
  kStickyAbort = 21,         // an earlier abort: no update lands after it
  kGlobalSpikeAbort = 22,    // skip.on_global_spike = "abort"
  kHardwareFaultAbort = 23,  // skip.on_hardware_fault = "abort"
  kInterrupted = 24,         // not an abort: a stop cut the step short
  kNonfiniteParameters = 25  // host: the model's own parameters (decide/judge.h: blame_model)
};

// The skip guard a skip now would trip. `recent_skips` of the last `recent` decisions (at most
// fraction_window; `oldest_skipped`: the oldest of them); `*skips_in_window` gets the window's
// skips with this one. `skip_seconds`: the compute the skips in a row cost with this one.
LOCKSTEP_HD inline Why guard_tripped(int64_t consecutive, int64_t max_consecutive,
                                     int64_t recent_skips, int64_t recent, bool oldest_skipped,
                                     double max_fraction, int64_t fraction_window,
                                     double skip_seconds, double max_seconds,
                                     int64_t* skips_in_window) {
  if (max_consecutive > 0 && consecutive + 1 > max_consecutive) return kMaxConsecutive;
  if (max_seconds > 0 && skip_seconds > max_seconds) return kMaxSeconds;
  if (max_fraction <= 0) return kNoWhy;
  int64_t skips = recent_skips + 1;
  if (recent == fraction_window && oldest_skipped) --skips;
  *skips_in_window = skips;
  return static_cast<double>(skips) > max_fraction * static_cast<double>(fraction_window)
             ? kMaxFraction
             : kNoWhy;
}

// ---- loss scaling -----------------------------------------------------------------------------

struct LossScaleState {
  double scale = 1;
  int64_t growth_tracker = 0;
  int64_t consecutive_overflows = 0;
};

struct LossScaleRule {
  bool enabled = false;  // static or dynamic: a nonfinite gradient with finite losses overflowed
  bool dynamic = false;
  double growth_factor = 2, backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

// An overflow backs off; every growth_interval clean updates grow the scale.
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

// The guard an overflow now would trip (kMaxOverflows, kScaleMin or kNoWhy).
LOCKSTEP_HD inline Why scale_guard(const LossScaleState& s, const LossScaleRule& rule,
                                   int64_t max_overflows, double min_scale) {
  if (max_overflows > 0 && s.consecutive_overflows + 1 > max_overflows) return kMaxOverflows;
  if (rule.dynamic && s.scale * rule.backoff_factor < min_scale) return kScaleMin;
  return kNoWhy;
}

}  // namespace lockstep::core
