#include "diag/injector.h"

#include <ATen/ops/ones.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/bitwise_xor.h>
#include <c10/core/GradMode.h>

#include <chrono>
#include <csignal>
#include <limits>
#include <thread>

#include "log.h"

namespace lockstep {

FaultInjector::FaultInjector(const FaultConfig& config, int rank, int world_size,
                             int restart_count)
    : plan_(config, world_size), rank_(rank), restart_count_(restart_count) {}

FaultKind FaultInjector::begin_step(int64_t step) {
  step_ = step;
  current_ = plan_.at(step, rank_);
  if (const double ms = plan_.slow_ms(rank_); ms > 0)  // a straggler (fault.slow_ranks)
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
  if (current_ == FaultKind::kCrash && restart_count_ == 0) {
    log::warn("step {}: fault injection: rank {} kills itself (SIGKILL)", step, rank_);
    log::flush();
    std::raise(SIGKILL);
  }
  return current_;
}

void FaultInjector::begin_computation(int batch_rank, int index) {
  const FaultKind batch = plan_.at(step_, batch_rank);
  data_ = is_data_fault(batch) ? batch : FaultKind::kNone;
  const bool sticky = current_ == FaultKind::kStickyNan || current_ == FaultKind::kStickyFlip;
  hardware_ = is_hardware_fault(current_) && (index == 0 || sticky) ? current_ : FaultKind::kNone;
  int64_t excluded = 0;
  for (int64_t r = 0; r < plan_.world_size(); ++r)
    excluded += plan_.at(step_, r) == FaultKind::kExcluded ? 1 : 0;
  const auto world = static_cast<double>(plan_.world_size());
  objective_factor_ = batch == FaultKind::kExcluded ? 0.0
                      : excluded > 0 ? world / (world - static_cast<double>(excluded))
                                     : 1.0;
}

at::Tensor FaultInjector::on_sample_losses(const at::Tensor& per_sample,
                                           const std::vector<int64_t>& ids, int64_t micro) const {
  const bool first = micro == 0;
  const bool nan_loss = first && data_ == FaultKind::kNanLoss;
  const bool spike = first && data_ == FaultKind::kSpike;
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
  const at::Tensor o = objective_factor_ != 1.0 ? objective.mul(objective_factor_) : objective;
  if (micro != 0) return o;
  if (data_ == FaultKind::kNanGrad) return o.mul(std::numeric_limits<double>::quiet_NaN());
  if (data_ == FaultKind::kInfGrad) return o.mul(std::numeric_limits<double>::infinity());
  if (data_ == FaultKind::kOverflow) return o.mul(16777216.0);  // 2^24, finite
  return o;
}

void FaultInjector::on_gradients(const std::vector<NamedTensor>& grads) const {
  if (hardware_ == FaultKind::kNone || grads.empty()) return;
  const c10::NoGradGuard no_grad;
  at::Tensor g = grads.back().tensor.view({-1});
  at::Tensor element = g.narrow(0, g.abs().argmax().item<int64_t>(), 1);
  if (hardware_ == FaultKind::kTransientNan || hardware_ == FaultKind::kStickyNan) {
    element.fill_(std::numeric_limits<double>::quiet_NaN());
    return;
  }
  // The bits of one element: the top exponent bit (a finite spike) or the lowest mantissa bit.
  const bool wide = g.scalar_type() == at::kFloat;
  const bool silent = hardware_ == FaultKind::kSilentFlip;
  const int64_t bit = silent ? 0 : (wide ? 30 : 14);  // fp32: exponent 30..23; 16-bit: 14..
  at::Tensor bits = element.view(wide ? at::kInt : at::kShort);
  bits.bitwise_xor_(wide ? int64_t{1} << bit : static_cast<int64_t>(int16_t(1 << bit)));
}

void FaultInjector::after_update(const std::vector<NamedTensor>& params) const {
  if (current_ != FaultKind::kDesync && current_ != FaultKind::kNanWeight) return;
  at::Tensor w = params.at(0).tensor.detach();
  if (current_ == FaultKind::kNanWeight)
    w.view({-1}).narrow(0, 0, 1).fill_(std::numeric_limits<double>::quiet_NaN());
  else
    w.view({-1}).narrow(0, 0, 1).add_(1e-3);
}

}  // namespace lockstep
