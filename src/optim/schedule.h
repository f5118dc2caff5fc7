// Learning-rate schedule: linear warmup, then linear / cosine / constant decay.
#pragma once

#include <cstdint>

#include "lockstep/config.h"

namespace lockstep {

struct LRScheduleOptions {
  double peak_lr = 3e-3;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  DecayType decay_type = DecayType::kCosine;
  double min_lr_factor = 0.0;
  OnSkip on_skip = OnSkip::kAdvance;
};

// The schedule a job's config describes (training.steps long).
LRScheduleOptions schedule_of(const Config& config);

// The lr of 0-based optimizer step `step`.
//   warmup (step < W):   peak * (step + 1) / (W + 1)          -- never exactly 0
//   decay  (step >= W):  p = (step - W) / max(1, total - W - 1), clamped to [0, 1]
//     linear:   peak * (1 - (1 - m) * p)
//     cosine:   peak * (m + (1 - m) * (1 + cos(pi * p)) / 2)
//     constant: peak
// so the last step (total - 1) runs at peak * min_lr_factor for linear and cosine.
double lr_at(const LRScheduleOptions& o, int64_t step);

// The lr of the next step of a run that has taken `steps` steps, `optimizer_steps` of which
// updated the weights: on_skip = advance follows the steps, hold the optimizer steps.
double next_lr(const LRScheduleOptions& o, int64_t steps, int64_t optimizer_steps);

}  // namespace lockstep
