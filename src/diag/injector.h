// Applies a fault plan (src/fault.h) to a running step, where bad data or bad hardware would
// act: the per-sample losses, the loss back-propagated, the process, the weights. Never inside
// the gradient check. The step calls it at these named points.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "fault.h"
#include "tensors.h"

namespace lockstep {

class FaultInjector {
 public:
  // `restart_count`: a crash fault fires on the first attempt only.
  FaultInjector(const FaultConfig& config, int rank, int world_size, int restart_count);

  bool empty() const { return plan_.empty(); }

  // The start of 1-based step `step`: this rank's fault for it. A crash kills the process here
  // (SIGKILL, as a machine failure would); a slow rank (fault.slow_ranks) sleeps here.
  FaultKind begin_step(int64_t step);
  FaultKind current() const { return current_; }  // the fault of the step begun last
  // A computation of this step on this rank: of rank `batch_rank`'s batch (its data faults
  // follow it), the `index`-th (0 = the first; replays count up; transient faults hit 0 only).
  void begin_computation(int batch_rank, int index);

  // Micro-batch `micro` of the step: the per-sample losses (B) of samples `ids` as bad data
  // makes them (poisoned samples NaN; nan_loss: the first one NaN; spike: all scaled).
  at::Tensor on_sample_losses(const at::Tensor& per_sample, const std::vector<int64_t>& ids,
                              int64_t micro) const;
  // The loss back-propagated (nan_grad, inf_grad: the gradient turns nonfinite while the
  // logged loss stays finite; overflow: x 2^24, which fp16 gradients cannot hold).
  at::Tensor on_objective(const at::Tensor& objective, int64_t micro) const;
  // After backward: what a hardware fault does to this rank's gradient `grads`.
  void on_gradients(const std::vector<NamedTensor>& grads) const;
  // After the update: desync perturbs this rank's weights (a silent divergence).
  void after_update(const std::vector<NamedTensor>& params) const;

 private:
  FaultPlan plan_;
  int rank_, restart_count_;
  int64_t step_ = 0;
  FaultKind current_ = FaultKind::kNone;
  FaultKind data_ = FaultKind::kNone, hardware_ = FaultKind::kNone;  // of the computation
  double objective_factor_ = 1;  // excluded: 0 on the excluded rank, W / (W - k) elsewhere
};

}  // namespace lockstep
