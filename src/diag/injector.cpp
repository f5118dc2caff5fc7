#include "diag/injector.h"

#include <ATen/ops/ones.h>
#include <c10/core/GradMode.h>

#include <csignal>
#include <limits>

#include "log.h"

namespace lockstep {

FaultInjector::FaultInjector(const FaultConfig& config, int rank, int world_size,
                             int restart_count)
    : plan_(config, world_size), rank_(rank), restart_count_(restart_count) {}

FaultKind FaultInjector::begin_step(int64_t step) {
  current_ = plan_.at(step, rank_);
  if (current_ == FaultKind::kCrash && restart_count_ == 0) {
    log::warn("step {}: fault injection: rank {} kills itself (SIGKILL)", step, rank_);
    log::flush();
    std::raise(SIGKILL);
  }
  return current_;
}

at::Tensor FaultInjector::on_sample_losses(const at::Tensor& per_sample,
                                           const std::vector<int64_t>& ids, int64_t micro) const {
  const bool first = micro == 0;
  const bool nan_loss = first && current_ == FaultKind::kNanLoss;
  const bool spike = first && current_ == FaultKind::kSpike;
  if (!plan_.has_poison() && !nan_loss && !spike) return per_sample;
  at::Tensor factor = at::ones({static_cast<int64_t>(ids.size())}, at::kFloat);
  float* f = factor.data_ptr<float>();
  for (size_t i = 0; i < ids.size(); ++i)
    if (plan_.poisoned(ids[i])) f[i] = std::numeric_limits<float>::quiet_NaN();
  if (nan_loss) f[0] = std::numeric_limits<float>::quiet_NaN();
  if (spike)
    for (size_t i = 0; i < ids.size(); ++i) f[i] *= static_cast<float>(plan_.spike_factor());
  return per_sample.mul(factor.to(per_sample.device()));
}

at::Tensor FaultInjector::on_objective(const at::Tensor& objective, int64_t micro) const {
  if (micro != 0) return objective;
  if (current_ == FaultKind::kNanGrad)
    return objective.mul(std::numeric_limits<double>::quiet_NaN());
  if (current_ == FaultKind::kInfGrad)
    return objective.mul(std::numeric_limits<double>::infinity());
  if (current_ == FaultKind::kOverflow) return objective.mul(16777216.0);  // 2^24, finite
  return objective;
}

void FaultInjector::after_update(const std::vector<NamedTensor>& params) const {
  if (current_ != FaultKind::kDesync) return;
  at::Tensor w = params.at(0).tensor.detach();
  w.view({-1}).narrow(0, 0, 1).add_(1e-3);
}

}  // namespace lockstep
