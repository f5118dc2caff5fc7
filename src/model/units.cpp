#include "model/units.h"

#include <ATen/Context.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>

namespace lockstep {
namespace {

// The states of the random generators a unit's forward draws from (dropout): the CPU's, and the
// GPU's when it runs there.
struct RngStates {
  at::Tensor cpu, device;
  c10::Device where{c10::kCPU};

  static RngStates take(c10::Device where) {
    RngStates s;
    s.where = where;
    s.cpu = state_of(c10::Device(c10::kCPU));
    if (!where.is_cpu()) s.device = state_of(where);
    return s;
  }
  void put() const {
    set(c10::Device(c10::kCPU), cpu);
    if (device.defined()) set(where, device);
  }

 private:
  static at::Tensor state_of(c10::Device d) {
    at::Generator gen = at::globalContext().defaultGenerator(d);
    const std::lock_guard<std::mutex> lock(gen.mutex());
    return gen.get_state();
  }
  static void set(c10::Device d, const at::Tensor& state) {
    at::Generator gen = at::globalContext().defaultGenerator(d);
    const std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
};

// The backward of a unit that kept only its input: the forward again, with the generators as
// they were when it first ran, then back-propagation through it (its parameters' gradients
// accumulate as they would have; the input's gradient goes on to the unit before).
struct RecomputeBackward final : torch::autograd::Node {
  RecomputeBackward(Units::Fn fn, at::Tensor input, RngStates rng)
      : fn_(std::move(fn)), input_(std::move(input)), rng_(std::move(rng)) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::Tensor x = input_.detach().requires_grad_(true);
    at::Tensor y;
    {
      const RngStates now = RngStates::take(input_.device());
      rng_.put();
      const c10::AutoGradMode grad(true);
      y = fn_(x);
      now.put();
    }
    torch::autograd::backward({y}, {grads.at(0)});
    input_.reset();  // its memory goes as soon as the unit is done
    return {x.grad()};
  }
  std::string name() const override { return "lockstep::RecomputeBackward"; }

 private:
  Units::Fn fn_;
  at::Tensor input_;
  RngStates rng_;
};

// torch 2.12+ holds autograd nodes in intrusive pointers, earlier ones in shared pointers.
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(
    std::declval<const torch::autograd::Variable&>()));
template <typename T, typename... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>)
    return std::make_shared<T>(std::forward<Args>(args)...);
  else
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
}

// fn(x) without keeping its activations: y takes RecomputeBackward as its gradient function.
at::Tensor recomputed(const at::Tensor& x, const Units::Fn& fn) {
  RngStates rng = RngStates::take(x.device());
  at::Tensor y;
  {
    const c10::AutoGradMode no_grad(false);
    y = fn(x);
  }
  NodePtr node = make_node<RecomputeBackward>(fn, x.detach(), std::move(rng));
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::create_gradient_edge(y, std::move(node));
  return y;
}

}  // namespace

at::Tensor Units::run(int unit, const at::Tensor& x, const Fn& fn) const {
  if (hooks_) hooks_->before_forward(unit);
  const bool grad = c10::GradMode::is_enabled();
  const bool recompute = grad && x.requires_grad() &&
                         unit < static_cast<int>(recompute_.size()) && recompute_[unit];
  at::Tensor y = recompute ? recomputed(x, fn) : fn(x);
  if (!hooks_) return y;
  hooks_->after_forward(unit);
  if (grad && y.requires_grad())
    y.register_hook([hooks = hooks_, unit](const at::Tensor&) { hooks->before_backward(unit); });
  return y;
}

}  // namespace lockstep
