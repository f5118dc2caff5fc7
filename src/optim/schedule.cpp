#include "optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace lockstep {

LRScheduleOptions schedule_of(const Config& c) {
  return {c.optimizer.lr, c.lr_scheduler.warmup_steps, c.training.steps,
          c.lr_scheduler.decay_type, c.lr_scheduler.min_lr_factor, c.lr_scheduler.on_skip};
}

double lr_at(const LRScheduleOptions& o, int64_t step) {
  if (step < o.warmup_steps)
    return o.peak_lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps + 1);
  if (o.decay_type == DecayType::kConstant) return o.peak_lr;
  const double span = static_cast<double>(std::max<int64_t>(1, o.total_steps - o.warmup_steps - 1));
  const double p = std::clamp(static_cast<double>(step - o.warmup_steps) / span, 0.0, 1.0);
  const double m = o.min_lr_factor;
  if (o.decay_type == DecayType::kLinear) return o.peak_lr * (1.0 - (1.0 - m) * p);
  return o.peak_lr * (m + (1.0 - m) * 0.5 * (1.0 + std::cos(std::numbers::pi * p)));
}

double next_lr(const LRScheduleOptions& o, int64_t steps, int64_t optimizer_steps) {
  return lr_at(o, o.on_skip == OnSkip::kHold ? optimizer_steps : steps);
}

}  // namespace lockstep
