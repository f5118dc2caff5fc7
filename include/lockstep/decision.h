// The decision types: what each rank contributes to a step's decision, and the verdict every
// rank derives from all contributions alike (src/decide/detector.h computes it). Plain C++.
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
constexpr int kRankStatsDoubles = 9;

// step; skip (nothing changes); abort; clip (a global spike, taken clipped to the window's
// bound); salvage (some ranks' contributions dropped before the sync, the rest stepped).
enum class Decision { kStep, kSkip, kAbort, kClip, kSalvage };
const char* decision_name(Decision d);  // "step", "skip", "abort", "clip", "salvage"

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

struct Verdict {
  Decision decision = Decision::kStep;
  std::vector<std::string> reasons;  // nonfinite_grad, nonfinite_loss, grad_norm_above_max,
                                     // grad_norm_spike, loss_spike; loss_scale_overflow alone
  std::string guard;                 // set when a guard turned a skip into an abort
  double grad_norm = 0;              // global, unscaled, before clipping; NaN when nonfinite > 0
  double nonfinite = 0;              // global nonfinite gradient elements
  double loss = 0;                   // global (mean over ranks)
  bool stop = false;                 // some rank asks to stop after this step (a signal)
  bool interrupted = false;          // a stop cut some rank's step short: nothing of it lands,
                                     // nothing is counted, the run stops at the step before
  double overflow_runs = 0;
  double grad_norm_z = 0, loss_z = 0;  // NaN while the window is too short or the test is off
  std::vector<int> culprit_ranks;      // local anomalies only: the ranks that stand out
  double loss_scale = 1;               // the scale this step's gradients carry (fp16)
  bool overflow = false;               // loss_scale_overflow: an fp16 overflow, not bad data
  std::string scope;                   // "local" (a minority of ranks), "global", or ""
  std::string cause;                   // kCause*, "" when unknown (no replay)
  std::vector<double> rank_grad_norm, rank_loss;      // each rank's own values (unscaled)
  std::vector<double> rank_grad_norm_z, rank_loss_z;  // ... against its own window (anomalous
                                                      // steps only: their events show them)
  std::vector<int> dropped_ranks;      // salvage: contributed nothing to the sync
  std::vector<ReplayResult> replays;
  std::vector<int> hardware_suspects;  // ranks whose device a replay or probe blamed
  double clip_to = 0;                  // clip: the grad norm the step is clipped to
  double clip = 1;                     // a taken step's update is scaled by this (<= 1)
  double compute_seconds = 0;          // the slowest rank's compute (skip.max_consecutive_seconds)
  // The per-tensor policies' part (decide/tensor_policies.h), on the same table everywhere:
  int64_t tensors_clipped = 0;             // AdaGC scaled this many tensors down
  std::vector<std::string> moments_reset;  // a global spike hit these: their moments zeroed
  // Something to explain: not a plain step (a transient fault repaired by a replay, or a probe
  // mismatch, is a step with reasons).
  bool anomalous() const { return decision != Decision::kStep || !reasons.empty(); }
  bool updates() const { return decision == Decision::kStep || decision == Decision::kClip ||
                                decision == Decision::kSalvage; }
};

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
