// The decision types: what each rank contributes to a step's decision, and the verdict every
// rank derives from all contributions alike (src/decide/detector.h computes it). Plain C++.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep {

// What one rank contributes to a step's decision: 8 doubles, 64 bytes, all-gathered once per
// step. Counts are integers held exactly in fp64 (up to 2^53).
struct RankStats {
  double shard_nonfinite = 0;  // [B] nonfinite elements in the synced shard this rank checks
  double shard_sumsq = 0;      // [B] sum of squares of that shard
  double local_nonfinite = 0;  // [A] nonfinite elements in this rank's own gradient, pre-sync
  double local_sumsq = 0;      // [A] its sum of squares (0 when diagnostics.local_check is off)
  double loss = 0;             // this rank's loss (mean over its tokens; all ranks hold as many)
  double stop_requested = 0;   // 1: this rank got SIGTERM or SIGINT and asks all to stop
  double overflow_runs = 0;    // [B] runs whose fp32 sum of squares overflowed (summed in fp64)
  double bad_samples = 0;      // samples of this rank's batch whose loss is nonfinite
};
static_assert(sizeof(RankStats) == 64, "one step's stats are 64 bytes per rank");
constexpr int kRankStatsDoubles = 8;

enum class Decision { kStep, kSkip, kAbort };
const char* decision_name(Decision d);  // "step", "skip", "abort"

struct Verdict {
  Decision decision = Decision::kStep;
  std::vector<std::string> reasons;  // nonfinite_grad, nonfinite_loss, grad_norm_above_max,
                                     // grad_norm_spike, loss_spike; loss_scale_overflow alone
  std::string guard;                 // set when a guard turned a skip into an abort
  double grad_norm = 0;              // global, unscaled, before clipping; NaN when nonfinite > 0
  double nonfinite = 0;              // global nonfinite gradient elements
  double loss = 0;                   // global (mean over ranks)
  bool stop = false;                 // some rank asks to stop after this step (a signal)
  double overflow_runs = 0;
  double grad_norm_z = 0, loss_z = 0;  // NaN while the window is too short or the test is off
  std::vector<int> culprit_ranks;      // ranks whose own data caused it, as far as knowable
  double loss_scale = 1;               // the scale this step's gradients carry (fp16)
  bool overflow = false;               // loss_scale_overflow: an fp16 overflow, not bad data
  bool anomalous() const { return decision != Decision::kStep; }
};

// A norm as users read it: NaN when any element is nonfinite, else sqrt(sumsq). (The check's
// sum of squares covers the finite elements only; events report that part as "finite_norm".)
double norm_of(double nonfinite, double sumsq);

}  // namespace lockstep
