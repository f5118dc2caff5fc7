// ddp: replicated parameters and optimizer; one all-reduce averages the flat gradient buffer.
#include "parallel/data_parallel.h"

namespace lockstep {
namespace {

class Ddp final : public DataParallel {
 public:
  Ddp(const std::vector<NamedTensor>& params, Comm* comm, const DataParallelOptions& o)
      : DataParallel(params, comm), optimizer_(AdamW::over(with_zero_moments(params), o.adamw)) {}

  std::string describe() const override { return "ddp data parallel"; }
  bool fused_optimizer() const override { return optimizer_.fused(); }

  void sync_gradients() override {
    if (world_ == 1) return;
    comm_->all_reduce_sum(flat_grad_);
    flat_grad_.div_(static_cast<double>(world_));
  }

  void apply(double lr, const UpdateControl& control) override { optimizer_.step(lr, control); }

  OptimizerPart optimizer_part(int64_t) override {
    return {OptimizerLayout::kPerParameter, optimizer_.state()};
  }
  void load_optimizer(MomentReader& moments) override {
    read_per_parameter(moments, params_, optimizer_.state());
  }
  std::vector<NamedTensor> replicated_optimizer_state() const override {
    return optimizer_.state();
  }

 private:
  AdamW optimizer_;
};

}  // namespace

std::unique_ptr<DataParallel> make_ddp(const std::vector<NamedTensor>& params, Comm* comm,
                                       const DataParallelOptions& options) {
  return std::make_unique<Ddp>(params, comm, options);
}

}  // namespace lockstep
