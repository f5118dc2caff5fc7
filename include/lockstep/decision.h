// What each rank contributes to a step's decision and what the decision costs (the verdict every
// rank derives from them is src/decide/verdict.h). Plain C++.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep {

// What one rank contributes to a step's decision: 9 doubles, 72 bytes, all-gathered once per
// step. Counts are integers held exactly in fp64 (up to 2^53).
struct RankStats {
  double shard_nonfinite = 0;  // [B] nonfinite elements in the synced shard this rank checks
  double shard_sumsq = 0;      // [B] sum of squares of that shard
  double local_nonfinite = 0;  // [A] nonfinite elements in this rank's own gradient, pre-sync
  double local_sumsq = 0;      // [A] its sum of squares (0 when diagnostics.local_check is off)
  double loss = 0;             // this rank's loss (mean over its tokens; all ranks hold as many)
  double stop_requested = 0;   // 1: this rank got SIGTERM or SIGINT and asks all to stop after
                               // this step; 2: the signal cut its step short (between
                               // micro-batches): its gradient is partial
  double overflow_runs = 0;    // [B] runs whose fp32 sum of squares overflowed (summed in fp64)
  double bad_samples = 0;      // samples of this rank's batch whose loss is nonfinite
  double compute_seconds = 0;  // its forward, backward and check [A] (diag/stragglers.h, and
                               // skip.max_consecutive_seconds' count); 0 = not measured
};
static_assert(sizeof(RankStats) == 72, "one step's stats are 72 bytes per rank");
constexpr int kRankStatsDoubles = 9;  // decide/verdict.h asserts each field against the core

// What recomputing one rank's batch found (skip.replay, diagnostics.replay_every): the same
// micro-batches, data faults and dropout masks, on the rank itself or on a peer.
struct ReplayResult {
  int rank = -1;            // whose batch was recomputed
  int by_rank = -1;         // the rank that recomputed it
  bool reproduced = false;  // loss and local gradient stats equal the first computation's
  double loss = 0, local_sumsq = 0, local_nonfinite = 0;  // what the recomputation gave
  double first_loss = 0, first_local_sumsq = 0, first_local_nonfinite = 0;  // ... and the first
};

// Why, as far as replays can tell: a batch that reproduces its anomaly anywhere is data; one
// that does not reproduce on its own device was a transient fault; one that reproduces there
// but not on a peer's is that device's hardware. A global anomaly is instability; nonfinite
// parameters are the model itself (decide/judge.h: blame_model).
inline constexpr const char* kCauseData = "data";
inline constexpr const char* kCauseTransient = "transient_fault";
inline constexpr const char* kCauseHardware = "hardware";
inline constexpr const char* kCauseInstability = "instability";
inline constexpr const char* kCauseModel = "model";

// What a step's decision machinery cost, in seconds (the metrics average it per step).
struct StepCosts {
  double decision = 0;  // checks [A] and [B], the stats exchange, the verdict
  double sync = 0;      // the gradient collective
  double triage = 0;    // the pre-sync exchange (skip.scope = "rank", skip.replay)
  double replay = 0;    // recomputations (replays and the probe)
  double wait = 0;      // the host blocked on a GPU's results (the table, or the device's verdict)
  int64_t waits = 0;    // ... that many times (a GPU run's host syncs, timed where they happen)
};

// A norm as users read it: NaN when any element is nonfinite, else sqrt(sumsq). (The check's
// sum of squares covers the finite elements only; events report that part as "finite_norm".)
double norm_of(double nonfinite, double sumsq);

}  // namespace lockstep
