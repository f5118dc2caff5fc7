#include "lockstep/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace lockstep {

double lr_at(const LRScheduleOptions& o, int64_t step) {
  if (step < o.warmup_steps)
    return o.peak_lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps + 1);
  if (o.decay_type == "constant") return o.peak_lr;
  const double span = static_cast<double>(std::max<int64_t>(1, o.total_steps - o.warmup_steps - 1));
  const double p = std::clamp(static_cast<double>(step - o.warmup_steps) / span, 0.0, 1.0);
  const double m = o.min_lr_factor;
  if (o.decay_type == "linear") return o.peak_lr * (1.0 - (1.0 - m) * p);
  return o.peak_lr * (m + (1.0 - m) * 0.5 * (1.0 + std::cos(std::numbers::pi * p)));
}

}  // namespace lockstep
