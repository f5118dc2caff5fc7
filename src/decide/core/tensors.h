// The per-tensor rules on a decided step: AdaGC's clip (skip.adaptive_clip = "adagc") and SPAM's
// moment reset (skip.spike_moment_reset), from every rank's per-tensor partial sums of squares
// ([W, tensors] doubles added in rank order: the same factors everywhere).
//
// AdaGC (arXiv 2502.11034): each tensor keeps a threshold gamma. During the first `warmup` taken
// steps training.max_norm acts alone and gamma tracks the minimum of the tensor's norms as taken;
// after them a norm above lambda * gamma is scaled down to that bound, and gamma = beta * gamma +
// (1 - beta) * (the norm as taken). Only taken, finite norms move gamma. The same bounds name the
// tensors a global spike hit (SPAM, arXiv 2501.06842): their AdamW moments are reset.
#pragma once

#include <cstdint>

#include "decide/core/step.h"

namespace lockstep::core {

struct TensorRule {
  int32_t clip = 0;   // AdaGC: scale the tensors above their bound down
  int32_t reset = 0;  // SPAM: reset the moments of the tensors a spike hit
  double lambda = 1.05, beta = 0.98;
  int64_t warmup = 100;
};

LOCKSTEP_HD inline double tensor_sumsq(const double* table, int world, int tensors, int i) {
  double s = 0;
  for (int r = 0; r < world; ++r) s += table[r * tensors + i];
  return s;
}

// Tensor i's global norm, unscaled.
LOCKSTEP_HD inline double tensor_norm(const double* sums, int world, int tensors, int i,
                                      double loss_scale) {
  return std::sqrt(tensor_sumsq(sums, world, tensors, i)) / loss_scale;
}

// The factor a tensor's update is scaled by (1: none); `count`: taken steps so far; `norm`: its
// norm as the global decision takes it.
LOCKSTEP_HD inline double tensor_clip_factor(const TensorRule& r, int64_t count, double gamma,
                                             double norm) {
  if (!r.clip || count < r.warmup || !std::isfinite(norm) || !(norm > r.lambda * gamma))
    return 1.0;
  return r.lambda * gamma / norm;
}

// A tensor's threshold after a taken step whose norm as taken (its factor applied) is `taken`.
LOCKSTEP_HD inline double tensor_threshold_after(const TensorRule& r, int64_t count, double gamma,
                                                 double taken) {
  if (!std::isfinite(taken)) return gamma;
  if (count == 0) return taken;
  if (count < r.warmup) return min_of(gamma, taken);
  return r.beta * gamma + (1.0 - r.beta) * taken;
}

// Whether a tensor's norm (unscaled, before any clip) stands above its bound.
LOCKSTEP_HD inline bool tensor_spiked(const TensorRule& r, int64_t count, double gamma,
                                      double norm) {
  return count > 0 && std::isfinite(norm) && norm > r.lambda * gamma;
}

// Whether the decided step is a global spike (not nonfinite, not an overflow) that the policy
// skipped or clipped: SPAM's reset acts on the tensors it hit.
LOCKSTEP_HD inline bool global_spike(const DecideResult& r, Scope scope) {
  if (scope != kGlobal || r.overflow || r.interrupted || (r.reasons & kNonfinite) ||
      !(r.reasons & kSpikes))
    return false;
  return r.outcome == kSkipStep || r.clipped;
}

// The same where no verdict carries the scope (the device): a clip is global by construction
// (apply_policy); a skip leaves the rank windows as they were, so the state after record_step
// gives the scope the decision saw.
LOCKSTEP_HD inline bool global_spike(const double* table, int world, const DecideState& s,
                                     const DecideConfig& c, const DecideResult& r) {
  return global_spike(r, kGlobal) &&
         (r.clipped || scope_in(table, world, s, c, r.reasons) == kGlobal);
}

struct TensorAction {
  double factor;  // its gradient x this before the update (1: not clipped)
  bool reset;     // its AdamW moments zeroed (their step counts kept)
};

LOCKSTEP_HD inline bool tensor_step_taken(const DecideResult& r) {
  return r.outcome == kTake && !r.overflow;
}

// Tensor i's part of the decided step `r`: `norm` its global norm (unscaled, before any clip),
// `taken` the taken steps before this one, `spike` global_spike's answer; `gamma` advances on a
// taken step with the norm as taken.
LOCKSTEP_HD inline TensorAction decide_tensor(const TensorRule& rule, int64_t taken,
                                              double& gamma, double norm, const DecideResult& r,
                                              bool spike) {
  TensorAction a{1.0, rule.reset != 0 && spike && tensor_spiked(rule, taken, gamma, norm)};
  if (!tensor_step_taken(r)) return a;
  const double as_taken = norm * r.clip;
  a.factor = tensor_clip_factor(rule, taken, gamma, as_taken);
  gamma = tensor_threshold_after(rule, taken, gamma, as_taken * a.factor);
  return a;
}

// Every tensor on one thread (the host's form of the device's kernel): `factors` and `resets`
// (1: reset) in fp32, as the update reads them; `taken` advanced.
LOCKSTEP_HD inline void decide_tensors(const double* table, int world, const double* sums,
                                       int tensors, const DecideState& s, const DecideConfig& c,
                                       const TensorRule& rule, const DecideResult& r,
                                       int64_t& taken, double* gamma, float* factors,
                                       float* resets) {
  const bool spike = rule.reset != 0 && global_spike(table, world, s, c, r);
  for (int i = 0; i < tensors; ++i) {
    const TensorAction a = decide_tensor(rule, taken, gamma[i],
                                         tensor_norm(sums, world, tensors, i, r.loss_scale), r,
                                         spike);
    factors[i] = static_cast<float>(a.factor);
    resets[i] = a.reset ? 1.0f : 0.0f;
  }
  if (tensor_step_taken(r)) ++taken;
}

}  // namespace lockstep::core
