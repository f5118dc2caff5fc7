#include "parallel/data_parallel.h"

#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>

namespace lockstep {

DataParallel::DataParallel(const std::vector<NamedTensor>& params, Comm* comm)
    : comm_(comm), params_(params) {
  world_ = comm_ ? comm_->size() : 1;
  rank_ = comm_ ? comm_->rank() : 0;
  for (const auto& p : params) total_ += p.tensor.numel();
  block_ = (total_ + world_ - 1) / world_;
  shard_offset_ = std::min<int64_t>(total_, rank_ * block_);
  shard_length_ = std::min<int64_t>(block_, total_ - shard_offset_);

  const auto options = params.at(0).tensor.options().requires_grad(false);
  flat_grad_ = at::zeros({world_ * block_}, options);
  int64_t off = 0;
  c10::AutoGradMode no_grad(false);
  for (const auto& p : params) {
    const int64_t n = p.tensor.numel();
    at::Tensor view = flat_grad_.narrow(0, off, n).view(p.tensor.sizes());
    p.tensor.mutable_grad() = view;
    grads_.push_back({p.name, view});
    off += n;
  }
}

void DataParallel::replicate_parameters() {
  if (!comm_) return;
  for (const auto& t : params_) {
    at::Tensor d = t.tensor.detach();
    comm_->broadcast(d, 0);
  }
}

std::unique_ptr<DataParallel> make_data_parallel(const std::vector<NamedTensor>& params,
                                                 Comm* comm, const DataParallelOptions& options) {
  switch (options.mode) {
    case ParallelMode::kDdp: return make_ddp(params, comm, options);
    case ParallelMode::kSharded: return make_sharded(params, comm, options);
  }
  throw std::invalid_argument("unknown parallelism.mode");
}

}  // namespace lockstep
