// ddp: replicated parameters and optimizer; one all-reduce averages the flat gradient buffer.
// In mixed precision every rank keeps the fp32 masters of all parameters (replicated too).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include "parallel/data_parallel.h"

namespace lockstep {
namespace {

class Ddp final : public DataParallel {
 public:
  Ddp(const std::vector<NamedTensor>& params, Comm* comm, const DataParallelOptions& o)
      : DataParallel(params, comm, o), optimizer_(AdamW::over(build_optimizer_params(), o.adamw)) {
    if (world_ > 1) build_buckets(o.bucket_bytes, o.overlap);
  }

  std::string describe() const override { return "ddp data parallel" + overlap_note(); }
  bool fused_optimizer() const override { return optimizer_.fused(); }

  void replicate_parameters() override {
    if (!master_.defined()) return DataParallel::replicate_parameters();
    if (comm_) comm_->broadcast(master_, 0);
    flat_param_.copy_(master_);
  }

  void sync_gradients(int contributors) override {
    if (buckets_) {
      // The buckets backward has not started, then every wait; each bucket's mean as it lands
      // (the same element-wise division as of the whole buffer), then its check [B].
      buckets_->finish([&](int b) {
        const auto [lo, n] = ranges_[b];
        reduce_.narrow(0, lo, n).div_(static_cast<double>(contributors));
        if (landed_) landed_(lo, lo + n);
      });
    } else {
      stage_for_reduction();
    }
    if (!opt_grad_.is_same(reduce_)) opt_grad_.copy_(reduce_);
  }

  AdamW& optimizer() override { return optimizer_; }

  void apply(double lr, const UpdateControl& control) override {
    optimizer_.step(lr, control);
    // The P-dtype copies (a skip's masters are unchanged; on the device the host cannot tell).
    if (master_.defined() && (!control.skip || control.on_device())) flat_param_.copy_(master_);
  }

  WeightSource weights() override { return {master_.defined() ? masters_ : params_, {}}; }
  OptimizerPart optimizer_part(int64_t) override {
    return {OptimizerLayout::kPerParameter, optimizer_.state()};
  }
  void load(CheckpointReader& reader) override {
    int64_t off = 0;
    for (const auto& w : master_.defined() ? masters_ : params_) {
      reader.fill_weights(w.tensor, off);
      off += w.tensor.numel();
    }
    read_per_parameter(reader, params_, optimizer_.state());
  }
  std::vector<NamedTensor> replicated_optimizer_state() const override {
    auto state = optimizer_.state();
    state.insert(state.end(), masters_.begin(), masters_.end());
    return state;
  }

 private:
  // Whole parameters from the last one back, about `bytes` of R per bucket; a bucket is cast or
  // copied from the local gradient into the reduce buffer (when that is another buffer) and
  // all-reduced there in place.
  void build_buckets(int64_t bytes, bool overlap) {
    const auto element = static_cast<int64_t>(c10::elementSize(reduce_dtype_));
    const int64_t per = std::max<int64_t>(1, bytes / element);  // elements per bucket
    std::vector<std::vector<int>> needs;
    int64_t hi = total_;
    for (int64_t lo = total_; lo > 0;) {
      lo -= params_[params_in(lo - 1, lo).front()].tensor.numel();  // the parameter ending at lo
      if (hi - lo >= per || lo == 0) {
        ranges_.emplace_back(lo, hi - lo);
        needs.push_back(params_in(lo, hi));
        hi = lo;
      }
    }
    auto start = [this](int b) {
      at::Tensor dst = reduce_.narrow(0, ranges_[b].first, ranges_[b].second);
      if (!reduce_.is_same(flat_grad_))
        dst.copy_(flat_grad_.narrow(0, ranges_[b].first, ranges_[b].second));
      return comm_->all_reduce_sum_async(dst);
    };
    buckets_ = std::make_unique<GradientBuckets>(params_, std::move(needs), start, overlap);
  }

  // What AdamW updates: the parameters themselves in fp32; else fp32 masters of all of them.
  // Its gradients are fp32: the reduce buffer when R is fp32, else the gradient buffer (P =
  // fp32) or a buffer of their own, refreshed from the reduce buffer after every sync.
  std::vector<AdamWParam> build_optimizer_params() {
    const auto fp32 = params_.at(0).tensor.options().requires_grad(false).dtype(at::kFloat);
    if (param_dtype_ != at::kFloat) {
      master_ = at::empty({total_}, fp32);
      flat_param_ = move_parameters(total_, master_, 0);
      masters_ = views_of(master_);
    }
    opt_grad_ = reduce_dtype_ == at::kFloat   ? reduce_
                : param_dtype_ == at::kFloat ? flat_grad_
                                             : at::zeros({world_ * block_}, fp32);
    const auto targets = master_.defined() ? masters_ : params_;
    const auto grads = views_of(opt_grad_);
    std::vector<AdamWParam> out;
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& t = targets[i].tensor;
      out.push_back({params_[i].name, t, grads[i].tensor, at::zeros_like(t), at::zeros_like(t),
                     t.dim() >= 2});
    }
    return out;
  }

  at::Tensor master_, flat_param_;  // mixed precision only: fp32 masters, P-dtype parameters
  at::Tensor opt_grad_;             // fp32 gradients the optimizer reads
  std::vector<NamedTensor> masters_;
  std::vector<std::pair<int64_t, int64_t>> ranges_;  // each bucket's flat offset and size
  AdamW optimizer_;
};

}  // namespace

std::unique_ptr<DataParallel> make_ddp(const std::vector<NamedTensor>& params, Comm* comm,
                                       const DataParallelOptions& options) {
  return std::make_unique<Ddp>(params, comm, options);
}

}  // namespace lockstep
