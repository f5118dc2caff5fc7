// sharded (ZeRO-2): the flat gradient buffer is reduce-scattered, rank r keeps the fp32 master
// weights and AdamW moments of block r, updates them, and the blocks are all-gathered into
// every rank's parameters (views into one flat parameter buffer). Collectives run in buckets,
// two in flight.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <fmt/core.h>

#include "parallel/data_parallel.h"

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

class Sharded final : public DataParallel {
 public:
  Sharded(const std::vector<NamedTensor>& params, Comm* comm, const DataParallelOptions& o)
      : DataParallel(params, comm),
        bucket_(std::max<int64_t>(1, o.bucket_bytes / 4 / world_)),
        master_(move_parameters_into_flat_buffer()),
        optimizer_(AdamW::over(block_params(), o.adamw)) {}

  std::string describe() const override {
    return fmt::format("sharded data parallel (this rank owns {} of {} parameters)",
                       shard_length_, total_);
  }
  bool fused_optimizer() const override { return optimizer_.fused(); }

  void replicate_parameters() override {
    DataParallel::replicate_parameters();
    master_.copy_(flat_param_.narrow(0, rank_ * block_, block_));  // the master follows
    gather_parameters();
  }

  void sync_gradients() override {
    if (world_ == 1) return;
    in_buckets([&](int64_t from, int64_t n) {
      at::Tensor out = grad_block_.narrow(0, from, n);
      return comm_->reduce_scatter_sum_async(rank_blocks(flat_grad_, from, n), out);
    });
    flat_grad_.narrow(0, rank_ * block_, block_)
        .copy_(grad_block_)
        .div_(static_cast<double>(world_));
  }

  void apply(double lr, const UpdateControl& control) override {
    optimizer_.step(lr, control);
    if (!control.skip) gather_parameters();  // a skip changed no block: nothing to gather
  }

  OptimizerPart optimizer_part(int64_t optimizer_steps) override {
    // Every block's AdamW step count equals the optimizer steps taken (a skip advances none).
    shard_steps_.fill_(static_cast<double>(optimizer_steps));
    return {OptimizerLayout::kFlatShards,
            {{"exp_avg", exp_avg_}, {"exp_avg_sq", exp_avg_sq_}, {"step", shard_steps_}},
            shard_offset_,
            shard_length_};
  }
  void load_optimizer(MomentReader& moments) override {
    moments.fill(exp_avg_, "exp_avg", shard_offset_);
    moments.fill(exp_avg_sq_, "exp_avg_sq", shard_offset_);
    optimizer_.set_step_count(moments.step());
  }
  std::vector<NamedTensor> replicated_optimizer_state() const override { return {}; }

 private:
  // Moves the parameters into one flat buffer (their values kept) and returns this rank's
  // master block. Pages are touched parameter by parameter and each old storage is released
  // right after its copy, so this does not first build a second full copy of the model.
  at::Tensor move_parameters_into_flat_buffer() {
    const auto options = params_.at(0).tensor.options().requires_grad(false);
    flat_param_ = at::empty({world_ * block_}, options);
    flat_param_.narrow(0, total_, world_ * block_ - total_).zero_();  // the padding
    c10::AutoGradMode no_grad(false);
    int64_t off = 0;
    for (const auto& p : params_) {
      const int64_t n = p.tensor.numel();
      at::Tensor pv = flat_param_.narrow(0, off, n).view(p.tensor.sizes());
      pv.copy_(p.tensor.detach());
      p.tensor.set_data(pv);  // the parameter now lives in the flat buffer
      off += n;
    }
    grad_block_ = at::empty({block_}, options);
    exp_avg_ = at::zeros({shard_length_}, options);
    exp_avg_sq_ = at::zeros({shard_length_}, options);
    // The master block, in the parameters' dtype: fp32, as the model trains in fp32.
    return flat_param_.narrow(0, rank_ * block_, block_).clone();
  }

  // The optimizer's tensors: the pieces of the master block, one per parameter it intersects,
  // named like it, with its decay; gradients and moments are views of flat blocks.
  std::vector<AdamWParam> block_params() {
    std::vector<AdamWParam> out;
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

  // This rank's master block -> every rank's parameters: one all-gather, in buckets.
  void gather_parameters() {
    if (world_ == 1) {
      flat_param_.copy_(master_);
      return;
    }
    in_buckets([&](int64_t from, int64_t n) {
      return comm_->all_gather_async(master_.narrow(0, from, n),
                                     rank_blocks(flat_param_, from, n));
    });
  }

  // Elements [from, from + n) of every rank's block of `flat`, in rank order.
  std::vector<at::Tensor> rank_blocks(const at::Tensor& flat, int64_t from, int64_t n) const {
    std::vector<at::Tensor> out;
    for (int r = 0; r < world_; ++r) out.push_back(flat.narrow(0, r * block_ + from, n));
    return out;
  }

  // Runs `start(from, n)` for each bucket of the block, two collectives in flight, all waited:
  // the next one is on its way while the last one finishes, and staging stays at two buckets.
  void in_buckets(const std::function<std::unique_ptr<CommWork>(int64_t, int64_t)>& start) {
    Pipeline works;
    for (int64_t from = 0; from < block_; from += bucket_)
      works.add(start(from, std::min(bucket_, block_ - from)));
    works.drain();
  }

  int64_t bucket_;  // elements per rank per call
  at::Tensor flat_param_, grad_block_, exp_avg_, exp_avg_sq_;
  at::Tensor shard_steps_ = at::zeros({}, at::kFloat);
  at::Tensor master_;
  AdamW optimizer_;
};

}  // namespace

std::unique_ptr<DataParallel> make_sharded(const std::vector<NamedTensor>& params, Comm* comm,
                                           const DataParallelOptions& options) {
  return std::make_unique<Sharded>(params, comm, options);
}

}  // namespace lockstep
