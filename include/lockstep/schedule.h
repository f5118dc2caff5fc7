// Learning-rate schedule: linear warmup, then linear / cosine / constant decay.
#pragma once

#include <cstdint>
#include <string>

namespace lockstep {

struct LRScheduleOptions {
  double peak_lr = 3e-3;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  std::string decay_type = "cosine";  // linear | cosine | constant
  double min_lr_factor = 0.0;
};

// The lr of 0-based optimizer step `step`.
//   warmup (step < W):   peak * (step + 1) / (W + 1)          -- never exactly 0
//   decay  (step >= W):  p = (step - W) / max(1, total - W - 1), clamped to [0, 1]
//     linear:   peak * (1 - (1 - m) * p)
//     cosine:   peak * (m + (1 - m) * (1 + cos(pi * p)) / 2)
//     constant: peak
// so the last step (total - 1) runs at peak * min_lr_factor for linear and cosine.
double lr_at(const LRScheduleOptions& o, int64_t step);

}  // namespace lockstep
