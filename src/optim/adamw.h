// AdamW on ATen's fused kernel. The kernel's `found_inf` and `grad_scale` inputs carry the
// skip decision and the clip coefficient, so neither needs a host sync or a second pass.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "lockstep/config.h"
#include "tensors.h"

namespace lockstep {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool fused = true;  // false: the for-loop implementation (same maths, one op at a time)
};
AdamWOptions adamw_options(const OptimizerConfig& config);

// What one update does, as the agreed decision says.
struct UpdateControl {
  bool skip = false;         // nothing changes at all, step counts included (found_inf = 1)
  double clip = 1.0;         // the unscaled gradients are multiplied by this
  double loss_scale = 1.0;   // the gradients carry this factor (fp16): divided out
  // What the fused kernel divides the gradients by: loss_scale / clip.
  double grad_scale() const { return loss_scale / clip; }
  // Decided on the device (skip.device_decision): found_inf and grad_scale as device scalars
  // (fp32), which the host does not read; the fields above are then unused.
  at::Tensor device_found_inf, device_grad_scale;
  bool on_device() const { return device_found_inf.defined(); }
  static UpdateControl on_device(const at::Tensor& found_inf, const at::Tensor& grad_scale) {
    UpdateControl c;
    c.device_found_inf = found_inf;
    c.device_grad_scale = grad_scale;
    return c;
  }
};

// One tensor the optimizer updates. The moments may be views into buffers the caller owns
// (the sharded mode keeps them flat, one block per rank); `grad` undefined: param.grad().
struct AdamWParam {
  std::string name;
  at::Tensor param, grad, exp_avg, exp_avg_sq;
  bool decay = true;
};

// The parameters with zeroed moments; matrices and embeddings (dim >= 2) get weight decay,
// norms and biases do not.
std::vector<AdamWParam> with_zero_moments(const std::vector<NamedTensor>& params);

class AdamW {
 public:
  // Matrices and embeddings (dim >= 2) get weight decay; norms and biases do not. Moments
  // start at zero.
  AdamW(const std::vector<NamedTensor>& params, AdamWOptions options);
  // Over tensors whose gradients, moments and decay the caller chose.
  static AdamW over(const std::vector<AdamWParam>& params, AdamWOptions options);

  // One update at learning rate `lr`. `grad_scale` (0-dim float, optional): gradients are
  // divided by it first (clipping passes 1 / clip_coef). `found_inf` (0-dim float, optional):
  // when it is 1 nothing changes at all, step counts included.
  void step(double lr, const at::Tensor& grad_scale = {}, const at::Tensor& found_inf = {});
  // The same with found_inf and grad_scale made from `control` on the parameters' device.
  void step(double lr, const UpdateControl& control);
  void zero_grad();
  // Per tensor, by name (the sharded mode's pieces carry their parameter's name): multiplies
  // the named tensors' gradients by their factor before the next step (AdaGC's clip; one
  // pass over those tensors only), or zeroes their moments (SPAM's reset; the step counts
  // stay, so the bias corrections do too).
  void scale_gradients(const std::unordered_map<std::string, double>& factors);
  void reset_moments(const std::unordered_set<std::string>& names);
  // The same decided on the device (skip.device_decision), with no host read: `factors` and
  // `resets` ([tensors] fp32 on the parameters' device; reset 1: zero) hold a value per name
  // of `order`, the per-tensor policies' list; only the tensors they act on are touched
  // (kernels/tensor_actions.h).
  void apply_on_device(const at::Tensor& factors, const at::Tensor& resets,
                       const std::vector<std::string>& order);
  // Sets every step count (a resumed sharded run reads one count for all).
  void set_step_count(double steps);

  // Moments and step counts, named "<param>.exp_avg", "<param>.exp_avg_sq", "<param>.step".
  std::vector<NamedTensor> state() const;
  // True when ATen's _fused_adamw_ is used.
  bool fused() const { return fused_; }

 private:
  struct Group {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
    std::vector<std::string> names;
    double weight_decay;
  };
  AdamW(AdamWOptions options) : opt_(options) {}
  const at::Tensor& first_param() const;
  void add(const std::vector<AdamWParam>& params);
  void step_group(Group& g, double lr, const at::Tensor& grad_scale, const at::Tensor& found_inf);
  void step_group_for_loop(Group& g, double lr, const at::Tensor& grad_scale);

  AdamWOptions opt_;
  bool fused_ = false;
  std::vector<Group> groups_;
  std::vector<std::vector<int32_t>> order_index_;  // apply_on_device: each tensor's place
};

// The clip coefficient as torch's clip_grad_norm_ computes it: min(1, max_norm / (norm + 1e-6)).
double clip_coefficient(double total_norm, double max_norm);

}  // namespace lockstep
