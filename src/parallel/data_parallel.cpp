#include "parallel/data_parallel.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>

#include "checkpoint/safetensors.h"
#include "parallel/pages.h"

namespace lockstep {

DataParallel::DataParallel(const std::vector<NamedTensor>& params, Comm* comm,
                           const DataParallelOptions& o, bool flat_gradients)
    : comm_(comm), param_dtype_(o.param_dtype), reduce_dtype_(o.reduce_dtype), params_(params) {
  world_ = comm_ ? comm_->size() : 1;
  rank_ = comm_ ? comm_->rank() : 0;
  for (const auto& p : params) total_ += p.tensor.numel();
  block_ = (total_ + world_ - 1) / world_;
  shard_offset_ = std::min<int64_t>(total_, rank_ * block_);
  shard_length_ = std::min<int64_t>(block_, total_ - shard_offset_);
  if (!flat_gradients) return;

  const auto options = params.at(0).tensor.options().requires_grad(false);
  flat_grad_ = returnable_zeros(world_ * block_, options.dtype(param_dtype_));
  // ddp overlapped reduces in place in a buffer of its own: the local gradient stays for [A]
  const bool own = reduce_dtype_ != param_dtype_ ||
                   (o.overlap && world_ > 1 && o.mode == ParallelMode::kDdp);
  reduce_ = own ? at::zeros({world_ * block_}, options.dtype(reduce_dtype_)) : flat_grad_;
  grads_ = views_of(flat_grad_);
  synced_ = views_of(reduce_);
  // The .grad of a P-dtype parameter must be P too: parameters still in fp32 at this point get
  // their view once move_parameters has cast them.
  if (param_dtype_ == params.at(0).tensor.scalar_type()) {
    c10::AutoGradMode no_grad(false);
    for (size_t i = 0; i < params.size(); ++i) params[i].tensor.mutable_grad() = grads_[i].tensor;
  }
}

std::vector<NamedTensor> DataParallel::views_of(const at::Tensor& flat) const {
  std::vector<NamedTensor> out;
  int64_t off = 0;
  for (const auto& p : params_) {
    const int64_t n = p.tensor.numel();
    out.push_back({p.name, flat.narrow(0, off, n).view(p.tensor.sizes())});
    off += n;
  }
  return out;
}

at::Tensor DataParallel::move_parameters(int64_t size, const at::Tensor& master, int64_t lo) {
  const auto options = params_.at(0).tensor.options().requires_grad(false).dtype(param_dtype_);
  at::Tensor flat = at::empty({size}, options);
  flat.narrow(0, total_, size - total_).zero_();  // the padding
  const int64_t hi = lo + (master.defined() ? master.numel() : 0);
  c10::AutoGradMode no_grad(false);
  int64_t off = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i].tensor;
    const int64_t n = p.numel();
    const int64_t a = std::max(off, lo), b = std::min(off + n, hi);
    if (a < b) master.narrow(0, a - lo, b - a).copy_(p.detach().view({-1}).narrow(0, a - off, b - a));
    at::Tensor pv = flat.narrow(0, off, n).view(p.sizes());
    pv.copy_(p.detach());
    p.set_data(pv);  // the parameter now lives in the flat buffer
    p.mutable_grad() = grads_[i].tensor;
    off += n;
  }
  return flat;
}

void DataParallel::zero_grad() { clear_pages(flat_grad_); }

void DataParallel::stage_for_reduction() {
  if (!reduce_.is_same(flat_grad_)) reduce_.copy_(flat_grad_);
}

std::string DataParallel::overlap_note() const {
  if (!buckets_ || !buckets_->overlapped()) return "";
  const int n = buckets_->size();
  return ", gradient sync overlapped with backward (" + std::to_string(n) +
         (n == 1 ? " bucket)" : " buckets)");
}

std::vector<int> DataParallel::params_in(int64_t lo, int64_t hi) const {
  std::vector<int> out;
  int64_t off = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t n = params_[i].tensor.numel();
    if (off < hi && lo < off + n) out.push_back(static_cast<int>(i));
    off += n;
  }
  return out;
}

uint32_t DataParallel::parameters_crc32() { return tensors_crc32_value(params_); }

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
    case ParallelMode::kFsdp: return make_fsdp(params, comm, options);
  }
  throw std::invalid_argument("unknown parallelism.mode");
}

}  // namespace lockstep
