// Loss scaling for fp16, decided in lockstep. The loss is multiplied by scale() before
// backward; fused AdamW divides it out again (with the clip coefficient, one pass). An overflow
// (nonfinite gradient with every loss finite) skips the step; the scale then backs off, and it
// grows after growth_interval clean updates. It changes only through record() of the agreed
// verdict, so every rank holds the same scale by construction; state() goes into checkpoints.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "kernels/decision.h"
#include "lockstep/config.h"

namespace lockstep {

class LossScaler {
 public:
  explicit LossScaler(const TrainingConfig& training);

  bool enabled() const { return mode_ != LossScaleMode::kNone; }
  double scale() const { return scale_; }  // 1 when off
  int64_t consecutive_overflows() const { return consecutive_overflows_; }

  // Its rule and state in the shared decision core's terms (the device decision starts from them).
  kernels::LossScaleRule rule() const;
  kernels::LossScaleState core_state() const {
    return {scale_, growth_tracker_, consecutive_overflows_};
  }

  // The guard an overflow at this step trips (it becomes an abort), or "".
  std::string guard_on_overflow() const;

  // Advances with a decided step: an overflow backs the scale off (dynamic), an update counts
  // toward growth. Anything else (another skip) changes nothing.
  void record(bool overflow, bool updated);

  // scale, growth tracker, consecutive overflows; doubles round-trip exactly through JSON.
  nlohmann::json state() const;
  void load_state(const nlohmann::json& state);  // {} = fresh

 private:
  LossScaleMode mode_;
  double scale_;
  double growth_factor_, backoff_factor_, min_;
  int64_t growth_interval_, max_overflows_;
  int64_t growth_tracker_ = 0, consecutive_overflows_ = 0;
};

}  // namespace lockstep
