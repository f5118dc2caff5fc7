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
      : DataParallel(params, comm, o), optimizer_(AdamW::over(build_optimizer_params(), o.adamw)) {}

  std::string describe() const override { return "ddp data parallel"; }
  bool fused_optimizer() const override { return optimizer_.fused(); }

  void replicate_parameters() override {
    if (!master_.defined()) return DataParallel::replicate_parameters();
    if (comm_) comm_->broadcast(master_, 0);
    flat_param_.copy_(master_);
  }

  void sync_gradients(int contributors) override {
    stage_for_reduction();
    if (world_ > 1) {
      comm_->all_reduce_sum(reduce_);
      reduce_.div_(static_cast<double>(contributors));
    }
    if (!opt_grad_.is_same(reduce_)) opt_grad_.copy_(reduce_);
  }

  void apply(double lr, const UpdateControl& control) override {
    optimizer_.step(lr, control);
    if (master_.defined() && !control.skip) flat_param_.copy_(master_);  // the P-dtype copies
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
  AdamW optimizer_;
};

}  // namespace

std::unique_ptr<DataParallel> make_ddp(const std::vector<NamedTensor>& params, Comm* comm,
                                       const DataParallelOptions& options) {
  return std::make_unique<Ddp>(params, comm, options);
}

}  // namespace lockstep
