#include "ddp.h"

#include <ATen/ops/zeros.h>

namespace lockstep {

DdpGradients::DdpGradients(const std::vector<NamedTensor>& params, Comm* comm) : comm_(comm) {
  int64_t total = 0;
  for (const auto& p : params) total += p.tensor.numel();
  flat_ = at::zeros({total}, params.at(0).tensor.options().requires_grad(false));
  int64_t off = 0;
  for (const auto& p : params) {
    at::Tensor view = flat_.narrow(0, off, p.tensor.numel()).view(p.tensor.sizes());
    p.tensor.mutable_grad() = view;
    grads_.push_back({p.name, view});
    off += p.tensor.numel();
  }
  const int w = comm_ ? comm_->size() : 1, r = comm_ ? comm_->rank() : 0;
  const int64_t per = (total + w - 1) / w;
  shard_offset_ = std::min<int64_t>(total, r * per);
  shard_length_ = std::min<int64_t>(per, total - shard_offset_);
}

void DdpGradients::average() {
  if (!comm_ || comm_->size() == 1) return;
  comm_->all_reduce_sum(flat_);
  flat_.div_(static_cast<double>(comm_->size()));
}

}  // namespace lockstep
