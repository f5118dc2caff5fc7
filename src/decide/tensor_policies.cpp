#include "decide/tensor_policies.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/slice.h>
#include <fmt/format.h>

#include "decide/detector.h"
#include "kernels/gradcheck.h"
#include "lockstep/error.h"

namespace lockstep {

TensorPolicies::TensorPolicies(const SkipConfig& skip, std::vector<std::string> names, Comm* comm)
    : rule_{skip.adaptive_clip == AdaptiveClip::kAdaGC ? 1 : 0, skip.spike_moment_reset ? 1 : 0,
            skip.adagc_lambda, skip.adagc_beta, skip.adagc_warmup},
      names_(std::move(names)),
      comm_(comm),
      gamma_(names_.size(), 0.0) {}

bool TensorPolicies::needs_norms(const Verdict& v) const {
  if (!active()) return false;
  const core::DecideResult r = result_of(v);
  return core::tensor_step_taken(r) ||
         (rule_.reset != 0 && core::global_spike(r, v.scope));
}

std::vector<double> TensorPolicies::norms(const at::Tensor& table, double loss_scale) const {
  const at::Tensor t = table.to(at::kCPU, at::kDouble).contiguous();
  const int world = static_cast<int>(t.size(0));
  const int tensors = static_cast<int>(t.size(1));
  std::vector<double> out;
  for (int i = 0; i < tensors; ++i)
    out.push_back(core::tensor_norm(t.const_data_ptr<double>(), world, tensors, i, loss_scale));
  return out;
}

TensorActions TensorPolicies::decide(const std::vector<double>& norms, Verdict& v) {
  TensorActions a;
  const core::DecideResult r = result_of(v);
  const bool spike = core::global_spike(r, v.scope);
  for (size_t i = 0; i < names_.size(); ++i) {
    const core::TensorAction t =
        core::decide_tensor(rule_, count_, gamma_[i], norms[i], r, spike);
    if (t.reset) {
      a.reset.insert(names_[i]);
      v.moments_reset.push_back(names_[i]);
    }
    if (t.factor < 1.0) a.factors[names_[i]] = t.factor;
  }
  if (!core::tensor_step_taken(r)) return a;
  v.tensors_clipped = static_cast<int64_t>(a.factors.size());
  ++count_;
  return a;
}

at::Tensor TensorPolicies::sums_of(const at::Tensor& shard_stats) const {
  // [3 + 2i + 1]: tensor i's sum of squares over this rank's part of the synced gradient
  const int64_t n = static_cast<int64_t>(names_.size());
  return shard_stats.slice(0, kernels::kStatsHeader + 1, kernels::kStatsHeader + 2 * n, 2);
}

at::Tensor TensorPolicies::with_sums(const at::Tensor& row, const at::Tensor& shard_stats) const {
  if (!active()) return row;
  return at::cat({row, sums_of(shard_stats)});
}

TensorStart TensorPolicies::device_start() const {
  if (!active()) return {};
  return {rule_, count_, gamma_};
}

TensorActions TensorPolicies::on_device(const DeviceDecision::Update& u) const {
  TensorActions a;
  if (!active()) return a;
  a.device_factors = u.factors;
  a.device_resets = u.resets;
  a.order = &names_;
  return a;
}

void TensorPolicies::mirror(int64_t step, const DeviceDecision::Readback& late, Verdict& v) {
  if (!active()) return;
  const TensorActions a = decide(norms(late.tensor_sums, v.loss_scale), v);
  for (size_t i = 0; i < names_.size(); ++i) {
    const auto f = a.factors.find(names_[i]);
    const float factor = f == a.factors.end() ? 1.0f : static_cast<float>(f->second);
    const float reset = a.reset.contains(names_[i]) ? 1.0f : 0.0f;
    if (late.factors[i] == factor && late.resets[i] == reset) continue;
    throw Error(ExitCode::kTrainingAborted,
                fmt::format("step {}: the device's per-tensor decision for {} (factor {}, reset "
                            "{}) differs from the host's (factor {}, reset {}); this is a bug in "
                            "lockstep: please report it; skip.device_decision = \"off\" decides "
                            "on the host only",
                            step, names_[i], late.factors[i], late.resets[i], factor, reset));
  }
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
