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

kernels::LossScaleRule LossScaler::rule() const {
  return {mode_ != LossScaleMode::kNone, mode_ == LossScaleMode::kDynamic, growth_factor_,
          backoff_factor_, growth_interval_};
}

std::string LossScaler::guard_on_overflow() const {
  switch (kernels::scale_guard(core_state(), rule(), max_overflows_, min_)) {
    case kernels::kMaxOverflows:
      return fmt::format("training.loss_scale_max_overflows = {}: {} overflows in a row",
                         max_overflows_, consecutive_overflows_ + 1);
    case kernels::kScaleMin:
      return fmt::format("training.loss_scale_min = {}: the scale would fall to {}", min_,
                         scale_ * backoff_factor_);
    case kernels::kNoScaleGuard: break;
  }
  return "";
}

void LossScaler::record(bool overflow, bool updated) {
  kernels::LossScaleState s = core_state();
  kernels::loss_scale_record(s, rule(), overflow, updated);
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
