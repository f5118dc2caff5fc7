// Fault injection ([fault]): what bad thing to simulate, where and when. This file is the
// plan: the kinds, the grammar of fault.inject / fault.poison_ids / fault.random_kinds, and the
// deterministic (step, rank) -> kind lookup. It has no tensors (the config reader validates
// with it); src/diag/injector.h applies a plan to a running step.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "lockstep/config.h"

namespace lockstep {

enum class FaultKind {
  kNone,
  kNanGrad,  // the loss back-propagated is multiplied by NaN (the logged loss stays finite)
  kInfGrad,  // ... by +inf
  kNanLoss,  // one sample's loss is NaN
  kSpike,    // the loss (and so the gradient) is multiplied by fault.spike_factor
  kCrash,    // the rank SIGKILLs itself (first attempt only: a machine failure)
  kDesync,   // the rank's weights are perturbed after the update (a silent divergence)
  kOverflow, // the loss back-propagated is multiplied by 2^24: fp16 gradients overflow to inf
  // Hardware: they act on the rank's gradient after backward, whichever batch it computed.
  // transient_*: the first computation of the step only (a replay comes out clean); sticky_*:
  // every computation of the step on that rank (a bad device). *_nan: one gradient element
  // becomes NaN; *_flip: the top exponent bit of the largest element of the last gradient
  // tensor flips (a finite spike); silent_flip: its lowest mantissa bit flips (no norm test
  // sees it; the probe, diagnostics.replay_every, does).
  kTransientNan,
  kTransientFlip,
  kStickyNan,
  kStickyFlip,
  kSilentFlip,
  // A test reference for a salvage: this rank's loss back-propagated is multiplied by 0 and
  // every other rank's by W / (W - k) (k ranks excluded at that step): the run in which this
  // rank's batch contributed nothing, built without the salvage machinery.
  kExcluded,
  // The model itself: one element of the rank's first parameter becomes NaN after the update
  // (as a NaN in imported weights would be). ddp and sharded (replicated parameters) only.
  kNanWeight,
};
bool is_hardware_fault(FaultKind kind);
// Faults that belong to the batch: a replay of that rank's batch, anywhere, meets them again.
bool is_data_fault(FaultKind kind);
const char* fault_name(FaultKind kind);  // "" for kNone, else "nan_grad", ...
const char* fault_meaning(FaultKind kind);  // one line
// Every kind with its meaning, a Markdown table (`lockstep config keys` prints it).
std::string fault_kinds_markdown();

// One injection from fault.inject: `kind` at 1-based step `step` on rank `rank`.
struct FaultInjection {
  FaultKind kind = FaultKind::kNone;
  int64_t step = 0;
  int64_t rank = 0;
};

// The grammar. Each throws ConfigError naming `key` and the bad item, with a typo hint.
std::vector<FaultInjection> parse_fault_inject(const std::string& text);  // "KIND@STEP:RANK, ..."
std::vector<FaultKind> parse_fault_kinds(const std::string& text, const std::string& key);
std::vector<int64_t> parse_id_list(const std::string& text, const std::string& key);

// Checks every string of [fault] (the config reader calls it).
void validate_fault_config(const FaultConfig& config);

class FaultPlan {
 public:
  // Throws ConfigError when an injection names a rank outside the world.
  FaultPlan(const FaultConfig& config, int64_t world_size);

  // The fault at 1-based step `step` on `rank`: an explicit injection, else a random one with
  // probability random_p (the same in every run and after every resume).
  FaultKind at(int64_t step, int64_t rank) const;
  bool poisoned(int64_t sample_id) const { return poison_.count(sample_id) != 0; }
  bool has_poison() const { return !poison_.empty(); }
  double spike_factor() const { return spike_factor_; }
  // fault.slow_ranks: the milliseconds `rank` sleeps in its compute each step (0: none).
  double slow_ms(int64_t rank) const { return slow_.count(rank) ? slow_ms_ : 0; }
  bool empty() const {
    return inject_.empty() && poison_.empty() && random_p_ == 0 && slow_.empty();
  }
  int64_t world_size() const { return world_size_; }

  // One JSON object per (step, rank) with a fault, steps 1..steps: `lockstep config faults`.
  std::string schedule_jsonl(int64_t steps) const;

 private:
  std::vector<FaultInjection> inject_;
  std::unordered_set<int64_t> poison_;
  std::unordered_set<int64_t> slow_;
  double slow_ms_ = 0;
  double random_p_, spike_factor_;
  uint64_t seed_;
  int64_t world_size_;
  std::vector<FaultKind> kinds_;
};

}  // namespace lockstep
