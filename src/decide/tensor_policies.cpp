#include "decide/tensor_policies.h"

#include <ATen/ops/slice.h>

#include <algorithm>
#include <cmath>

#include "kernels/gradcheck.h"
#include "lockstep/error.h"

namespace lockstep {

void TensorActions::apply_to(AdamW& optimizer) const {
  if (!reset.empty()) optimizer.reset_moments(reset);
  if (!factors.empty()) optimizer.scale_gradients(factors);
}

TensorPolicies::TensorPolicies(const SkipConfig& skip, std::vector<std::string> names, Comm* comm)
    : rule_{skip.adaptive_clip == AdaptiveClip::kAdaGC ? 1 : 0, skip.adagc_lambda,
            skip.adagc_beta, skip.adagc_warmup},
      reset_(skip.spike_moment_reset),
      names_(std::move(names)),
      comm_(comm),
      gamma_(names_.size(), 0.0) {}

namespace {

// A global spike (not a nonfinite value, not a local anomaly) the decision skipped or clipped.
bool global_spike(const Verdict& v) {
  if (v.overflow || v.scope != "global") return false;
  if (v.decision != Decision::kSkip && v.decision != Decision::kClip) return false;
  bool spike = false;
  for (const std::string& r : v.reasons) {
    if (r.starts_with("nonfinite")) return false;
    spike = spike || r == "grad_norm_spike" || r == "loss_spike" || r == "grad_norm_above_max" ||
            r == "grad_norm_zclip";
  }
  return spike;
}

}  // namespace

bool TensorPolicies::needs_norms(const Verdict& v) const {
  return active() && ((v.updates() && !v.overflow) || (reset_ && global_spike(v)));
}

std::vector<double> TensorPolicies::norms(const at::Tensor& table, double loss_scale) const {
  const at::Tensor t = table.to(at::kCPU, at::kDouble).contiguous();
  const int world = static_cast<int>(t.size(0));
  const int tensors = static_cast<int>(t.size(1));
  std::vector<double> out;
  for (int i = 0; i < tensors; ++i)
    out.push_back(std::sqrt(kernels::tensor_sumsq(t.data_ptr<double>(), world, tensors, i)) /
                  loss_scale);
  return out;
}

TensorActions TensorPolicies::decide(const std::vector<double>& norms, Verdict& v) {
  TensorActions a;
  if (reset_ && global_spike(v))
    for (size_t i = 0; i < names_.size(); ++i)
      if (kernels::tensor_spiked(rule_, count_, gamma_[i], norms[i])) {
        a.reset.insert(names_[i]);
        v.moments_reset.push_back(names_[i]);
      }
  if (!v.updates() || v.overflow) return a;
  for (size_t i = 0; i < names_.size(); ++i) {
    const double norm = norms[i] * v.clip;  // as the global decision takes it
    const double f = kernels::tensor_clip_factor(rule_, count_, gamma_[i], norm);
    if (f < 1.0) a.factors[names_[i]] = f;
    gamma_[i] = kernels::tensor_threshold_after(rule_, count_, gamma_[i], norm * f);
  }
  v.tensors_clipped = static_cast<int64_t>(a.factors.size());
  ++count_;
  return a;
}

TensorActions TensorPolicies::step(const at::Tensor& shard_stats, Verdict& v) {
  if (!needs_norms(v)) return {};
  const int64_t n = static_cast<int64_t>(names_.size());
  // [3 + 2i + 1]: tensor i's sum of squares over this rank's part of the synced gradient
  const at::Tensor mine =
      shard_stats.slice(0, kernels::kStatsHeader + 1, kernels::kStatsHeader + 2 * n, 2)
          .contiguous();
  return decide(norms(all_gather_rows(comm_, mine), v.loss_scale), v);
}

nlohmann::json TensorPolicies::state() const {
  nlohmann::json thresholds = nlohmann::json::object();
  for (size_t i = 0; i < names_.size(); ++i) thresholds[names_[i]] = gamma_[i];
  return {{"taken", count_}, {"thresholds", thresholds}};
}

void TensorPolicies::load_state(const nlohmann::json& j) {
  const nlohmann::json& t = j.at("thresholds");
  for (size_t i = 0; i < names_.size(); ++i) {
    if (!t.contains(names_[i]))
      throw InputError("the checkpoint's per-tensor thresholds (skip.adaptive_clip) have no "
                       "entry for " + names_[i] + "; resume with the model it was saved with");
    gamma_[i] = t.at(names_[i]).get<double>();
  }
  count_ = j.at("taken").get<int64_t>();
}

}  // namespace lockstep
