#include "optim/adamw.h"

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <cmath>
#include <stdexcept>

#if __has_include(<ATen/ops/_fused_adamw.h>)
#include <ATen/ops/_fused_adamw.h>
#define LOCKSTEP_HAVE_FUSED_ADAMW 1
#else
#define LOCKSTEP_HAVE_FUSED_ADAMW 0
#endif

#include "decide/core/rules.h"
#include "optim/tensor_values.h"

namespace lockstep {

AdamWOptions adamw_options(const OptimizerConfig& c) {
  return {c.beta1, c.beta2, c.eps, c.weight_decay, c.implementation == AdamWImpl::kFused};
}

std::vector<AdamWParam> with_zero_moments(const std::vector<NamedTensor>& params) {
  std::vector<AdamWParam> out;
  for (const auto& p : params)
    out.push_back({p.name, p.tensor, {}, at::zeros_like(p.tensor), at::zeros_like(p.tensor),
                   p.tensor.dim() >= 2});
  return out;
}

AdamW::AdamW(const std::vector<NamedTensor>& params, AdamWOptions options) : opt_(options) {
  add(with_zero_moments(params));
}

AdamW AdamW::over(const std::vector<AdamWParam>& params, AdamWOptions options) {
  AdamW a(options);
  a.add(params);
  return a;
}

void AdamW::add(const std::vector<AdamWParam>& params) {
  fused_ = opt_.fused && LOCKSTEP_HAVE_FUSED_ADAMW;
  groups_.resize(2);
  groups_[0].weight_decay = opt_.weight_decay;
  groups_[1].weight_decay = 0.0;
  for (const auto& p : params) {
    Group& g = groups_[p.decay ? 0 : 1];
    g.names.push_back(p.name);
    g.params.push_back(p.param);
    g.grads.push_back(p.grad);
    g.exp_avgs.push_back(p.exp_avg);
    g.exp_avg_sqs.push_back(p.exp_avg_sq);
    // fp32 step counts on the parameter's device, as the fused kernel wants them.
    g.steps.push_back(at::zeros({}, p.param.options().dtype(at::kFloat)));
  }
}

void AdamW::step(double lr, const at::Tensor& grad_scale, const at::Tensor& found_inf) {
  for (auto& g : groups_)
    if (!g.params.empty()) step_group(g, lr, grad_scale, found_inf);
}

void AdamW::step(double lr, const UpdateControl& control) {
  if (control.on_device()) return step(lr, control.device_grad_scale, control.device_found_inf);
  at::Tensor grad_scale, found_inf;
  const auto options = first_param().options();
  if (control.skip) found_inf = at::ones({}, options);
  if (control.grad_scale() != 1.0) grad_scale = at::empty({}, options).fill_(control.grad_scale());
  step(lr, grad_scale, found_inf);
}

const at::Tensor& AdamW::first_param() const {
  for (const auto& g : groups_)
    if (!g.params.empty()) return g.params.front();
  throw std::invalid_argument("AdamW: no parameters");
}

void AdamW::step_group(Group& g, double lr, const at::Tensor& grad_scale,
                       const at::Tensor& found_inf) {
  std::vector<at::Tensor> grads;
  grads.reserve(g.params.size());
  for (size_t i = 0; i < g.params.size(); ++i) {
    at::Tensor& p = g.params[i];
    if (g.grads[i].defined()) {
      grads.push_back(g.grads[i]);
      continue;
    }
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    grads.push_back(p.grad());
  }
  // The step count advances by (1 - found_inf): unchanged on a skipped step, and without
  // reading found_inf on the host.
  if (found_inf.defined())
    at::_foreach_add_(g.steps, found_inf.mul(-1.0).add(1.0));
  else
    at::_foreach_add_(g.steps, 1.0);

#if LOCKSTEP_HAVE_FUSED_ADAMW
  if (fused_) {
    std::optional<at::Tensor> gs, fi;
    if (grad_scale.defined()) gs = grad_scale;
    if (found_inf.defined()) fi = found_inf;
    at::_fused_adamw_(g.params, grads, g.exp_avgs, g.exp_avg_sqs, /*max_exp_avg_sqs=*/{},
                      g.steps, lr, opt_.beta1, opt_.beta2, g.weight_decay, opt_.eps,
                      /*amsgrad=*/false, /*maximize=*/false, gs, fi);
    return;
  }
#endif
  if (found_inf.defined() && found_inf.item<float>() != 0.0f) return;
  step_group_for_loop(g, lr, grad_scale);
}

void AdamW::step_group_for_loop(Group& g, double lr, const at::Tensor& grad_scale) {
  for (size_t i = 0; i < g.params.size(); ++i) {
    at::Tensor p = g.params[i].detach();  // update in place, outside autograd
    at::Tensor grad = g.grads[i].defined() ? g.grads[i] : g.params[i].grad();
    if (grad_scale.defined()) grad = grad.div(grad_scale);
    const double step = g.steps[i].item<double>();
    const double bc1 = 1.0 - std::pow(opt_.beta1, step);
    const double bc2 = 1.0 - std::pow(opt_.beta2, step);
    p.mul_(1.0 - lr * g.weight_decay);
    g.exp_avgs[i].lerp_(grad, 1.0 - opt_.beta1);
    g.exp_avg_sqs[i].mul_(opt_.beta2).addcmul_(grad, grad, 1.0 - opt_.beta2);
    at::Tensor denom = g.exp_avg_sqs[i].sqrt().div_(std::sqrt(bc2)).add_(opt_.eps);
    p.addcdiv_(g.exp_avgs[i], denom, -lr / bc1);
  }
}

void AdamW::zero_grad() {
  for (auto& g : groups_)
    for (size_t i = 0; i < g.params.size(); ++i)
      if (g.grads[i].defined())
        g.grads[i].zero_();
      else if (g.params[i].grad().defined())
        g.params[i].mutable_grad().zero_();
}

void AdamW::scale_gradients(const std::unordered_map<std::string, double>& factors) {
  for (auto& g : groups_)
    for (size_t i = 0; i < g.params.size(); ++i) {
      const auto f = factors.find(g.names[i]);
      if (f == factors.end()) continue;
      (g.grads[i].defined() ? g.grads[i] : g.params[i].mutable_grad()).mul_(f->second);
    }
}

void AdamW::reset_moments(const std::unordered_set<std::string>& names) {
  for (auto& g : groups_)
    for (size_t i = 0; i < g.params.size(); ++i)
      if (names.contains(g.names[i])) {
        g.exp_avgs[i].zero_();
        g.exp_avg_sqs[i].zero_();
      }
}

void AdamW::apply_on_device(const at::Tensor& factors, const at::Tensor& resets,
                            const std::vector<std::string>& order) {
  if (order_index_.empty()) {
    std::unordered_map<std::string, int32_t> place;
    for (size_t i = 0; i < order.size(); ++i) place.emplace(order[i], static_cast<int32_t>(i));
    for (const auto& g : groups_) {
      order_index_.emplace_back();
      for (const auto& name : g.names) order_index_.back().push_back(place.at(name));
    }
  }
  std::vector<at::Tensor> grads, moments;
  std::vector<int32_t> grad_index, moment_index;
  for (size_t k = 0; k < groups_.size(); ++k) {
    Group& g = groups_[k];
    for (size_t i = 0; i < g.params.size(); ++i) {
      const int32_t index = order_index_[k][i];
      at::Tensor& p = g.params[i];
      if (!g.grads[i].defined() && !p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      grads.push_back(g.grads[i].defined() ? g.grads[i] : p.grad());
      grad_index.push_back(index);
      moments.insert(moments.end(), {g.exp_avgs[i], g.exp_avg_sqs[i]});
      moment_index.insert(moment_index.end(), {index, index});
    }
  }
  apply_tensor_values(moments, moment_index, resets, kernels::kZeroIf);
  apply_tensor_values(grads, grad_index, factors, kernels::kScaleBy);
}

void AdamW::set_step_count(double steps) {
  for (auto& g : groups_)
    for (auto& s : g.steps) s.fill_(steps);
}

std::vector<NamedTensor> AdamW::state() const {
  std::vector<NamedTensor> out;
  for (const auto& g : groups_)
    for (size_t i = 0; i < g.params.size(); ++i) {
      out.push_back({g.names[i] + ".exp_avg", g.exp_avgs[i]});
      out.push_back({g.names[i] + ".exp_avg_sq", g.exp_avg_sqs[i]});
      out.push_back({g.names[i] + ".step", g.steps[i]});
    }
  return out;
}

double clip_coefficient(double total_norm, double max_norm) {
  return core::clip_coefficient(total_norm, max_norm);  // the device's too
}

}  // namespace lockstep
