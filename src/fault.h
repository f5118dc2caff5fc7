// Fault injection ([fault]): where and what bad data to simulate. The trainer applies it
// where bad data would act, to the batch's per-sample losses and to the loss it
// back-propagates, never inside the gradient check. Deterministic: a (step, rank) gets the
// same fault in every run and after every resume.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "lockstep/config.h"

namespace lockstep {

class FaultPlan {
 public:
  // Throws ConfigError when an injection names a rank outside the world.
  FaultPlan(const FaultConfig& config, int64_t world_size);

  // The fault kind at 1-based step `step` on `rank` ("" = none): an explicit injection, else
  // a random one with probability random_p.
  std::string at(int64_t step, int64_t rank) const;
  bool poisoned(int64_t sample_id) const { return poison_.count(sample_id) != 0; }
  bool has_poison() const { return !poison_.empty(); }
  double spike_factor() const { return spike_factor_; }
  bool empty() const { return inject_.empty() && poison_.empty() && random_p_ == 0; }

 private:
  std::vector<FaultInjection> inject_;
  std::unordered_set<int64_t> poison_;
  double random_p_, spike_factor_;
  uint64_t seed_;
  std::vector<std::string> kinds_;
};

}  // namespace lockstep
