// sharded (ZeRO-2): the flat gradient buffer is reduce-scattered, rank r keeps the fp32 master
// weights and AdamW moments of block r, updates them, and the blocks are all-gathered into
// every rank's parameters (views into one flat parameter buffer). Collectives run in buckets,
// two in flight; with overlap the reduce-scatters start during backward, two in flight too.
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <fmt/core.h>

#include <algorithm>
#include <functional>
#include <utility>

#include "parallel/data_parallel.h"

namespace lockstep {
namespace {

// At most two collectives in flight: adding a third waits for the oldest. `landed` runs right
// after its collective's wait.
class Pipeline {
 public:
  void add(std::unique_ptr<CommWork> w, std::function<void()> landed = {}) {
    if (in_flight_.size() == 2) wait_oldest();
    in_flight_.push_back({std::move(w), std::move(landed)});
  }
  void drain() {
    while (!in_flight_.empty()) wait_oldest();
  }

 private:
  void wait_oldest() {
    in_flight_.front().first->wait();
    if (in_flight_.front().second) in_flight_.front().second();
    in_flight_.erase(in_flight_.begin());
  }
  std::vector<std::pair<std::unique_ptr<CommWork>, std::function<void()>>> in_flight_;
};

class Sharded final : public DataParallel {
 public:
  Sharded(const std::vector<NamedTensor>& params, Comm* comm, const DataParallelOptions& o)
      : DataParallel(params, comm, o),
        bucket_(std::max<int64_t>(1, o.bucket_bytes / 4 / world_)),
        optimizer_(AdamW::over(build_block(), o.adamw)) {
    if (o.overlap && world_ > 1) {  // without: in_buckets, two in flight
      grad_block_ = at::empty({block_}, reduce_.options());
      build_buckets();
    }
  }

  std::string describe() const override {
    return fmt::format("sharded data parallel (this rank owns {} of {} parameters){}",
                       shard_length_, total_, overlap_note());
  }
  bool fused_optimizer() const override { return optimizer_.fused(); }

  void replicate_parameters() override {
    // Fresh in fp32: rank 0's weights for all, the masters follow them. Loaded, or in mixed
    // precision: the masters (from the checkpoint, or the fp32 initialisation) are the truth.
    if (param_dtype_ == at::kFloat && !loaded_) DataParallel::replicate_parameters();
    gather_parameters();
  }

  void sync_gradients(int contributors) override {
    // As each slice of this rank's block lands: its mean into the block's place in the reduce
    // buffer (the same element-wise division as of the whole block), then its check [B].
    const auto landed = [&](int64_t from, int64_t n) {
      at::Tensor mine = reduce_.narrow(0, rank_ * block_ + from, n);
      if (grad_block_.defined()) mine.copy_(grad_block_.narrow(0, from, n));
      mine.div_(static_cast<double>(contributors));
      if (landed_) landed_(rank_ * block_ + from, rank_ * block_ + from + n);
    };
    if (buckets_) {
      // The buckets backward has not started yet, then every wait.
      buckets_->finish([&](int b) { landed(slices_[b].first, slices_[b].second); });
    } else {
      stage_for_reduction();
      if (world_ > 1)
        in_buckets([&](int64_t from, int64_t n) { return reduce_scatter(from, n); }, landed);
    }
    if (opt_grad_block_.defined()) opt_grad_block_.copy_(reduce_.narrow(0, rank_ * block_, block_));
  }

  AdamW& optimizer() override { return optimizer_; }

  void apply(double lr, const UpdateControl& control) override {
    optimizer_.step(lr, control);
    // A skip changed no block: nothing to gather (on the device the host cannot tell: gather).
    if (!control.skip || control.on_device()) gather_parameters();
  }

  // The fp32 weights: the parameters themselves when they are fp32 (the gathered masters, bit
  // for bit); else each piece broadcast by the rank whose master block holds it.
  WeightSource weights() override {
    if (param_dtype_ == at::kFloat) return {params_, {}};
    return {params_, [this](int64_t lo, int64_t n, float* dst) { gather_weights(lo, n, dst); }};
  }
  void load(CheckpointReader& reader) override {
    // Only this rank's block: the masters (fp32 whatever the compute dtype), then the moments.
    const int64_t n = std::min(block_, std::max<int64_t>(0, total_ - rank_ * block_));
    if (n > 0) reader.fill_weights(master_.narrow(0, 0, n), rank_ * block_);
    loaded_ = true;
    reader.fill_moment(exp_avg_, "exp_avg", shard_offset_);
    reader.fill_moment(exp_avg_sq_, "exp_avg_sq", shard_offset_);
    optimizer_.set_step_count(reader.step());
  }

  OptimizerPart optimizer_part(int64_t optimizer_steps) override {
    // Every block's AdamW step count equals the optimizer steps taken (a skip advances none).
    shard_steps_.fill_(static_cast<double>(optimizer_steps));
    return {OptimizerLayout::kFlatShards,
            {{"exp_avg", exp_avg_}, {"exp_avg_sq", exp_avg_sq_}, {"step", shard_steps_}},
            {{shard_offset_, shard_length_}}};
  }
  std::vector<NamedTensor> replicated_optimizer_state() const override { return {}; }

 private:
  // Elements [from, from + n) of every rank's block, reduce-scattered into this rank's own
  // block of them (in place: the Comm stages what a backend cannot write over its input), or
  // with overlap into grad_block_: there they land during backward, and check [A] reads this
  // rank's own block after it.
  std::unique_ptr<CommWork> reduce_scatter(int64_t from, int64_t n) {
    at::Tensor out = grad_block_.defined() ? grad_block_.narrow(0, from, n)
                                           : reduce_.narrow(0, rank_ * block_ + from, n);
    return comm_->reduce_scatter_sum_async(rank_blocks(reduce_, from, n), out);
  }

  // Overlap: the same calls as without it (so the same sums, bit for bit), started from the
  // end of the blocks back: a call is ready once the parameters of all its W pieces are.
  void build_buckets() {
    std::vector<std::vector<int>> needs;
    for (int64_t from = (block_ - 1) / bucket_ * bucket_; from >= 0; from -= bucket_) {
      const int64_t n = std::min(bucket_, block_ - from);
      std::vector<int> need;
      for (int r = 0; r < world_; ++r)
        for (int p : params_in(r * block_ + from, r * block_ + from + n)) need.push_back(p);
      std::sort(need.begin(), need.end());
      need.erase(std::unique(need.begin(), need.end()), need.end());
      slices_.emplace_back(from, n);
      needs.push_back(std::move(need));
    }
    auto start = [this](int b) {
      const auto [from, n] = slices_[b];
      if (!reduce_.is_same(flat_grad_))
        for (int r = 0; r < world_; ++r)
          reduce_.narrow(0, r * block_ + from, n).copy_(flat_grad_.narrow(0, r * block_ + from, n));
      return reduce_scatter(from, n);
    };
    // Two in flight, as without overlap: a reduce-scatter holds copies of its bucket (Gloo's
    // of the W pieces, the staged block it lands in) until it is waited for.
    buckets_ = std::make_unique<GradientBuckets>(params_, std::move(needs), start, true, 2);
  }

  // This rank's block: the parameters move into one flat P-dtype buffer, the fp32 master block
  // takes their fp32 values (in fp32 it is their own block of that buffer, no copy), and the
  // optimizer gets the pieces of the master block, one per parameter it intersects (named like
  // it, with its decay), gradients and moments as views of flat blocks (fp32 gradients: the
  // reduce buffer's block, or a block of their own).
  std::vector<AdamWParam> build_block() {
    const auto fp32 = params_.at(0).tensor.options().requires_grad(false).dtype(at::kFloat);
    if (param_dtype_ == at::kFloat) {
      flat_param_ = move_parameters(world_ * block_, at::Tensor(), 0);
      master_ = flat_param_.narrow(0, rank_ * block_, block_);
    } else {
      master_ = at::zeros({block_}, fp32);
      flat_param_ = move_parameters(world_ * block_, master_, rank_ * block_);
      if (world_ > 1) param_block_ = at::empty({block_}, flat_param_.options());  // one rank copies
    }
    if (reduce_dtype_ != at::kFloat) opt_grad_block_ = at::zeros({block_}, fp32);
    const at::Tensor grads = opt_grad_block_.defined() ? opt_grad_block_
                                                       : reduce_.narrow(0, rank_ * block_, block_);
    exp_avg_ = at::zeros({shard_length_}, fp32);
    exp_avg_sq_ = at::zeros({shard_length_}, fp32);
    std::vector<AdamWParam> out;
    int64_t off = 0;
    for (const auto& p : params_) {
      const int64_t n = p.tensor.numel();
      const int64_t lo = std::max(off, shard_offset_);
      const int64_t hi = std::min(off + n, shard_offset_ + shard_length_);
      if (lo < hi) {
        const int64_t at_block = lo - rank_ * block_;
        out.push_back({p.name, master_.narrow(0, at_block, hi - lo),
                       grads.narrow(0, at_block, hi - lo), exp_avg_.narrow(0, at_block, hi - lo),
                       exp_avg_sq_.narrow(0, at_block, hi - lo), p.tensor.dim() >= 2});
      }
      off += n;
    }
    return out;
  }

  // Elements [lo, lo + n) of the flat fp32 weights into dst on every rank: piece by piece,
  // each broadcast by the rank whose master block holds it.
  void gather_weights(int64_t lo, int64_t n, float* dst) {
    for (int64_t done = 0; done < n;) {
      const int64_t at = lo + done, owner = at / block_;
      const int64_t take = std::min(n - done, (owner + 1) * block_ - at);
      at::Tensor piece = master_.narrow(0, at - owner * block_, take);
      if (comm_) {
        at::Tensor buf = owner == rank_ ? piece.clone() : at::empty({take}, master_.options());
        comm_->broadcast(buf, static_cast<int>(owner));
        piece = buf;
      }
      at::from_blob(dst + done, {take}, at::kFloat).copy_(piece);
      done += take;
    }
  }

  // This rank's master block -> every rank's parameters: one all-gather, in buckets, of the
  // block in the parameters' dtype.
  void gather_parameters() {
    if (world_ == 1) {
      if (!master_.is_alias_of(flat_param_)) flat_param_.copy_(master_);
      return;
    }
    const at::Tensor source = param_block_.defined() ? param_block_.copy_(master_) : master_;
    in_buckets([&](int64_t from, int64_t n) {
      at::Tensor into = rank_blocks(flat_param_, from, n);
      return comm_->all_gather_async(source.narrow(0, from, n), into);
    });
  }

  // Elements [from, from + n) of every rank's block of `flat`, in rank order: a [W, n] view
  // whose rows are contiguous (the Comm's blocks, read and written where they lie).
  at::Tensor rank_blocks(const at::Tensor& flat, int64_t from, int64_t n) const {
    return flat.view({world_, block_}).narrow(1, from, n);
  }

  // Runs `start(from, n)` for each bucket of the block, two collectives in flight, all waited
  // (then `landed(from, n)`): the next one is on its way while the last one finishes, and
  // staging stays at two buckets.
  void in_buckets(const std::function<std::unique_ptr<CommWork>(int64_t, int64_t)>& start,
                  const std::function<void(int64_t, int64_t)>& landed = {}) {
    Pipeline works;
    for (int64_t from = 0; from < block_; from += bucket_) {
      const int64_t n = std::min(bucket_, block_ - from);
      std::function<void()> then;
      if (landed) then = [&landed, from, n] { landed(from, n); };
      works.add(start(from, n), std::move(then));
    }
    works.drain();
  }

  int64_t bucket_;  // elements per rank per call
  std::vector<std::pair<int64_t, int64_t>> slices_;  // overlap: each bucket's [from, from + n)
  at::Tensor flat_param_;      // P: every rank's parameters
  at::Tensor master_;          // fp32: this rank's block of the weights, what AdamW updates
                               // (P = fp32: flat_param_'s own block)
  at::Tensor param_block_;     // P != fp32: the master block cast for the all-gather
  at::Tensor grad_block_;      // R, overlap only: the reduce-scatters' results, before the division
  at::Tensor opt_grad_block_;  // R != fp32: this rank's synced block in fp32
  at::Tensor exp_avg_, exp_avg_sq_;
  bool loaded_ = false;  // the masters came from a checkpoint
  at::Tensor shard_steps_ = at::zeros({}, at::kFloat);
  AdamW optimizer_;
};

}  // namespace

std::unique_ptr<DataParallel> make_sharded(const std::vector<NamedTensor>& params, Comm* comm,
                                           const DataParallelOptions& options) {
  return std::make_unique<Sharded>(params, comm, options);
}

}  // namespace lockstep
