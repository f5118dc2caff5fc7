#include "parallel.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>

namespace lockstep {
namespace {

// At most two collectives in flight: adding a third waits for the oldest.
class Pipeline {
 public:
  void add(std::unique_ptr<CommWork> w) {
    if (in_flight_.size() == 2) {
      in_flight_.front()->wait();
      in_flight_.erase(in_flight_.begin());
    }
    in_flight_.push_back(std::move(w));
  }
  void drain() {
    for (auto& w : in_flight_) w->wait();
    in_flight_.clear();
  }

 private:
  std::vector<std::unique_ptr<CommWork>> in_flight_;
};

}  // namespace

DataParallel::DataParallel(const std::vector<NamedTensor>& params, Comm* comm, bool sharded,
                           int64_t bucket_bytes)
    : comm_(comm), sharded_(sharded), params_(params) {
  world_ = comm_ ? comm_->size() : 1;
  rank_ = comm_ ? comm_->rank() : 0;
  for (const auto& p : params) total_ += p.tensor.numel();
  block_ = (total_ + world_ - 1) / world_;
  shard_offset_ = std::min<int64_t>(total_, rank_ * block_);
  shard_length_ = std::min<int64_t>(block_, total_ - shard_offset_);
  bucket_ = std::max<int64_t>(1, bucket_bytes / 4 / world_);

  const auto options = params.at(0).tensor.options().requires_grad(false);
  flat_grad_ = at::zeros({world_ * block_}, options);
  if (sharded_) {
    // Pages are touched parameter by parameter below and each old storage is released right
    // after its copy, so setup does not first build a second full copy of the model.
    flat_param_ = at::empty({world_ * block_}, options);
    flat_param_.narrow(0, total_, world_ * block_ - total_).zero_();  // the padding
  }
  int64_t off = 0;
  c10::AutoGradMode no_grad(false);
  for (const auto& p : params) {
    const int64_t n = p.tensor.numel();
    at::Tensor view = flat_grad_.narrow(0, off, n).view(p.tensor.sizes());
    p.tensor.mutable_grad() = view;
    grads_.push_back({p.name, view});
    if (sharded_) {
      at::Tensor pv = flat_param_.narrow(0, off, n).view(p.tensor.sizes());
      pv.copy_(p.tensor.detach());
      p.tensor.set_data(pv);  // the parameter now lives in the flat buffer
    }
    off += n;
  }
  if (sharded_) {
    // The master block, in the parameters' dtype: fp32, as the model trains in fp32.
    master_ = flat_param_.narrow(0, rank_ * block_, block_).clone();
    grad_block_ = at::empty({block_}, options);
    exp_avg_ = at::zeros({shard_length_}, options);
    exp_avg_sq_ = at::zeros({shard_length_}, options);
  }
}

void DataParallel::sync_gradients() {
  if (world_ == 1) return;
  if (!sharded_) {
    comm_->all_reduce_sum(flat_grad_);
    flat_grad_.div_(static_cast<double>(world_));
    return;
  }
  in_buckets([&](int64_t from, int64_t n) {
    at::Tensor out = grad_block_.narrow(0, from, n);
    return comm_->reduce_scatter_sum_async(rank_blocks(flat_grad_, from, n), out);
  });
  flat_grad_.narrow(0, rank_ * block_, block_).copy_(grad_block_).div_(static_cast<double>(world_));
}

std::vector<AdamWParam> DataParallel::optimizer_params() {
  if (!sharded_) return with_zero_moments(params_);
  std::vector<AdamWParam> out;
  // The parameters that intersect [shard_offset, shard_offset + shard_length).
  int64_t off = 0;
  for (const auto& p : params_) {
    const int64_t n = p.tensor.numel();
    const int64_t lo = std::max(off, shard_offset_);
    const int64_t hi = std::min(off + n, shard_offset_ + shard_length_);
    if (lo < hi) {
      const int64_t at_block = lo - rank_ * block_;
      out.push_back({p.name, master_.narrow(0, at_block, hi - lo),
                     flat_grad_.narrow(0, lo, hi - lo), exp_avg_.narrow(0, at_block, hi - lo),
                     exp_avg_sq_.narrow(0, at_block, hi - lo), p.tensor.dim() >= 2});
    }
    off += n;
  }
  return out;
}

void DataParallel::gather_parameters(bool from_params) {
  if (!sharded_) return;
  if (from_params) master_.copy_(flat_param_.narrow(0, rank_ * block_, block_));
  if (world_ == 1) {
    flat_param_.copy_(master_);
    return;
  }
  in_buckets([&](int64_t from, int64_t n) {
    return comm_->all_gather_async(master_.narrow(0, from, n), rank_blocks(flat_param_, from, n));
  });
}

void DataParallel::zero_grad() { flat_grad_.zero_(); }

std::vector<at::Tensor> DataParallel::rank_blocks(const at::Tensor& flat, int64_t from,
                                                  int64_t n) const {
  std::vector<at::Tensor> out;
  for (int r = 0; r < world_; ++r) out.push_back(flat.narrow(0, r * block_ + from, n));
  return out;
}

void DataParallel::in_buckets(
    const std::function<std::unique_ptr<CommWork>(int64_t from, int64_t n)>& start) {
  // Two buckets in flight at a time: the next one is on its way while the last one finishes,
  // and the backends' staging stays at two buckets.
  Pipeline works;
  for (int64_t from = 0; from < block_; from += bucket_)
    works.add(start(from, std::min(bucket_, block_ - from)));
  works.drain();
}

}  // namespace lockstep
