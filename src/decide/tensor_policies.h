// The per-tensor policies of the decision (skip.adaptive_clip = "adagc": AdaGC's clip of each
// tensor to its own EMA; skip.spike_moment_reset: SPAM's reset of the moments a global spike
// hit), over the one core's rules (decide/core/tensors.h). After the agreed global
// decision, every rank gathers every rank's per-tensor partial sums of squares (check [B]'s
// stats buffer: one more small all-gather, [W, tensors] doubles) on the steps that need them, adds
// them in rank order and reaches the same factors and the same reset tensors. Its thresholds
// travel in checkpoints with the detector's state; they do not depend on the world size.
// Decided on the device (skip.device_decision), the sums ride along the step's one all-gather
// (with_sums), the device decides every tensor and the optimizer acts on what it wrote; a step
// later the host decides the same from the copied sums and checks they agree (mirror). The
// PyTorch guard runs the same decide() over sums it exchanges itself (python/csrc/ext.cpp);
// step() and TensorActions::apply_to, lockstep's own step's side, are in tensor_policies_trainer.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "decide/device_decision.h"
#include "decide/core/step.h"
#include "decide/core/tensors.h"
#include "lockstep/config.h"
#include "decide/verdict.h"
#include "optim/adamw.h"

namespace lockstep {

// What a decided step does per tensor (by parameter name), before its update.
struct TensorActions {
  std::unordered_map<std::string, double> factors;  // clipped tensors: their gradient x factor
  std::unordered_set<std::string> reset;            // their AdamW moments zeroed
  // Decided on the device: a factor and a reset flag per tensor of `order` (the host reads
  // neither; the maps above stay empty).
  at::Tensor device_factors, device_resets;
  const std::vector<std::string>* order = nullptr;
  // Before the update: the resets, then the factors (nothing when there are none).
  void apply_to(AdamW& optimizer) const;
};

class TensorPolicies {
 public:
  // `names`: the parameters in model order (check [B]'s). With neither policy on it does
  // nothing at all (no collective, no state).
  TensorPolicies(const SkipConfig& skip, std::vector<std::string> names, Comm* comm);
  bool active() const { return rule_.clip != 0 || rule_.reset != 0; }

  // (tensor_policies_trainer.cpp) The per-tensor part of the decided step `v` from this rank's check [B]
  // stats buffer (kernels/gradcheck.h's layout): the factors of a taken step, the tensors a
  // global spike hit; notes them in `v` (tensors_clipped, moments_reset) and advances the
  // thresholds on a taken step. Collective on the steps that need the norms: every rank calls it with the same
  // verdict, so all gather or none do.
  TensorActions step(const at::Tensor& shard_stats, Verdict& v);

  // The global per-tensor norms (unscaled) from the [W, tensors] table of partial sums.
  std::vector<double> norms(const at::Tensor& table, double loss_scale) const;
  // The same decision from given norms (what step() does after the gather; pure but for the
  // thresholds it advances on a taken step).
  TensorActions decide(const std::vector<double>& norms, Verdict& v);

  // This rank's per-tensor partial sums of squares (fp64, strided) from check [B]'s stats.
  at::Tensor sums_of(const at::Tensor& shard_stats) const;
  // On the device: this rank's row of stats `row` followed by its per-tensor sums from check
  // [B]'s `shard_stats` (the row alone when neither policy is on), for the one all-gather.
  at::Tensor with_sums(const at::Tensor& row, const at::Tensor& shard_stats) const;
  // The state the device starts from, and what the optimizer does with its decision.
  TensorStart device_start() const;
  TensorActions on_device(const DeviceDecision::Update& u) const;
  // A step later: the same decision on the host from the device's copied sums, noted in `v`
  // (the thresholds advance as on the host path); throws (exit code 4) when the device's
  // factors or resets differ, a bug.
  void mirror(int64_t step, const DeviceDecision::Readback& late, Verdict& v);

  // Whether the decided step `v` reads the per-tensor norms (step() gathers the sums then).
  bool needs_norms(const Verdict& v) const;
  const std::vector<std::string>& names() const { return names_; }
  int64_t taken() const { return count_; }
  const std::vector<double>& thresholds() const { return gamma_; }
  nlohmann::json state() const;
  void load_state(const nlohmann::json& state);

 private:

  core::TensorRule rule_;
  std::vector<std::string> names_;
  Comm* comm_;
  int64_t count_ = 0;          // taken steps seen (the warm-up's clock)
  std::vector<double> gamma_;  // each tensor's threshold
};

}  // namespace lockstep
