#include "parallel/overlap.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <stdexcept>

namespace lockstep {

namespace {

// Runs after autograd's AccumulateGrad of one parameter: its .grad holds this backward's share.
struct AccumulatedHook final : torch::autograd::FunctionPostHook {
  explicit AccumulatedHook(std::function<void()> ready) : ready_(std::move(ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    ready_();
    return outputs;
  }

 private:
  std::function<void()> ready_;
};

}  // namespace

std::function<void()> on_gradient_accumulated(const at::Tensor& param, const std::string& name,
                                              std::function<void()> ready) {
  // Held by the returned function: the parameter itself only keeps a weak reference to it.
  auto acc = torch::autograd::impl::grad_accumulator(param);
  if (!acc)
    throw std::invalid_argument(name + " has no gradient accumulator (not a leaf requiring grad)");
  const uintptr_t key = acc->add_post_hook(std::make_unique<AccumulatedHook>(std::move(ready)));
  return [acc, key] { acc->del_post_hook(key); };
}

GradientBuckets::GradientBuckets(const std::vector<NamedTensor>& params,
                                 std::vector<std::vector<int>> needs, Start start, bool overlap,
                                 int max_in_flight)
    : needs_(std::move(needs)), buckets_of_(params.size()), start_(std::move(start)),
      max_in_flight_(max_in_flight) {
  for (size_t b = 0; b < needs_.size(); ++b)
    for (int p : needs_[b]) {
      if (p < 0 || p >= static_cast<int>(params.size()))
        throw std::out_of_range("GradientBuckets: a bucket names no parameter");
      buckets_of_[p].push_back(static_cast<int>(b));
    }
  pending_.resize(needs_.size());
  for (size_t b = 0; b < needs_.size(); ++b) pending_[b] = static_cast<int>(needs_[b].size());
  for (size_t i = 0; i < params.size() && overlap; ++i) {
    if (buckets_of_[i].empty()) continue;
    unhook_.push_back(on_gradient_accumulated(params[i].tensor, "GradientBuckets: " + params[i].name,
                                              [this, i] { ready(static_cast<int>(i)); }));
  }
}

// Works still in flight here belong to a step that failed: the job is ending, and waiting for
// each (a lost rank: a timeout each) would only delay the exit.
GradientBuckets::~GradientBuckets() {
  for (auto& u : unhook_) u();
}

void GradientBuckets::arm() {
  const std::lock_guard<std::mutex> lock(mu_);
  armed_ = true;
  started_in_backward_ = 0;
  start_ready();  // buckets with no parameter at all
}

void GradientBuckets::ready(int param) {
  const std::lock_guard<std::mutex> lock(mu_);
  if (!armed_) return;
  for (int b : buckets_of_[param]) --pending_[b];
  start_ready();
}

void GradientBuckets::start_ready() {
  while (next_ < size() && pending_[next_] <= 0) {
    start_next();
    ++started_in_backward_;
  }
}

void GradientBuckets::start_next() {
  if (max_in_flight_ > 0 && works_.size() - waited_ >= static_cast<size_t>(max_in_flight_))
    works_[waited_++]->wait();  // finish() waits for it again: nothing left to do then
  works_.push_back(start_(next_++));
}

void GradientBuckets::finish(const std::function<void(int bucket)>& landed) {
  std::vector<std::unique_ptr<CommWork>> works;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    if (!armed_) started_in_backward_ = 0;
    while (next_ < size()) start_next();
    works.swap(works_);
    waited_ = 0;
    armed_ = false;
    next_ = 0;
    for (size_t b = 0; b < needs_.size(); ++b) pending_[b] = static_cast<int>(needs_[b].size());
  }
  for (size_t b = 0; b < works.size(); ++b) {
    works[b]->wait();
    if (landed) landed(static_cast<int>(b));
  }
}

}  // namespace lockstep
