#include "decide/loss_scale.h"

#include <fmt/format.h>

#include "kernels/decision.h"

namespace lockstep {

LossScaler::LossScaler(const TrainingConfig& t)
    : mode_(loss_scale_setting(t).mode),
      scale_(loss_scale_setting(t).value),
      growth_factor_(t.loss_scale_growth_factor),
      backoff_factor_(t.loss_scale_backoff_factor),
      min_(t.loss_scale_min),
      growth_interval_(t.loss_scale_growth_interval),
      max_overflows_(t.loss_scale_max_overflows) {}

std::string LossScaler::guard_on_overflow() const {
  if (max_overflows_ > 0 && consecutive_overflows_ + 1 > max_overflows_)
    return fmt::format("training.loss_scale_max_overflows = {}: {} overflows in a row",
                       max_overflows_, consecutive_overflows_ + 1);
  if (mode_ == LossScaleMode::kDynamic && scale_ * backoff_factor_ < min_)
    return fmt::format("training.loss_scale_min = {}: the scale would fall to {}", min_,
                       scale_ * backoff_factor_);
  return "";
}

void LossScaler::record(bool overflow, bool updated) {
  // The shared decision core's rule (kernels/decision.h), the device's too.
  kernels::LossScaleState s{scale_, growth_tracker_, consecutive_overflows_};
  kernels::loss_scale_record(
      s, {enabled(), mode_ == LossScaleMode::kDynamic, growth_factor_, backoff_factor_,
          growth_interval_},
      overflow, updated);
  scale_ = s.scale;
  growth_tracker_ = s.growth_tracker;
  consecutive_overflows_ = s.consecutive_overflows;
}

nlohmann::json LossScaler::state() const {
  return {{"scale", scale_},
          {"growth_tracker", growth_tracker_},
          {"consecutive_overflows", consecutive_overflows_}};
}

void LossScaler::load_state(const nlohmann::json& s) {
  if (s.empty()) return;
  if (mode_ == LossScaleMode::kDynamic) scale_ = s.at("scale").get<double>();
  growth_tracker_ = s.at("growth_tracker").get<int64_t>();
  consecutive_overflows_ = s.at("consecutive_overflows").get<int64_t>();
}

}  // namespace lockstep
