// The per-tensor policies in lockstep's own step (decide/tensor_policies.h): the gather of the
// per-tensor sums on the host-decided path and the optimizer's side. Apart from
// tensor_policies.cpp, which the PyTorch package compiles too (its guard has its own optimizer
// and process group).
#include "decide/tensor_policies.h"

namespace lockstep {

void TensorActions::apply_to(AdamW& optimizer) const {
  if (device_factors.defined())
    return optimizer.apply_on_device(device_factors, device_resets, *order);
  if (!reset.empty()) optimizer.reset_moments(reset);
  if (!factors.empty()) optimizer.scale_gradients(factors);
}

TensorActions TensorPolicies::step(const at::Tensor& shard_stats, Verdict& v) {
  if (!needs_norms(v)) return {};
  return decide(norms(all_gather_rows(comm_, sums_of(shard_stats).contiguous()), v.loss_scale), v);
}

}  // namespace lockstep
