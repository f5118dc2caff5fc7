// The verdict every rank derives from the same table: the core's result in the core's types
// (outcome, reason bits, why, scope) with the names the host adds (culprits, causes, replays).
// Names and English are made only where a line, an event or a message is written (names.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "decide/core/step.h"
#include "lockstep/decision.h"

namespace lockstep {

// step; skip (nothing changes); abort; clip (a global spike, taken clipped to the window's
// bound); salvage (some ranks' contributions dropped before the sync, the rest stepped).
enum class Decision { kStep, kSkip, kAbort, kClip, kSalvage };

// The one mapping between the core's outcome and the decision.
Decision decision_of(core::Outcome outcome, bool clipped, bool salvaged);
core::Outcome outcome_of(Decision d);

// The layout of RankStats is the core's row (decide/core/rules.h: StatsField).
static_assert(offsetof(RankStats, shard_nonfinite) == core::kShardNonfinite * sizeof(double));
static_assert(offsetof(RankStats, shard_sumsq) == core::kShardSumsq * sizeof(double));
static_assert(offsetof(RankStats, local_nonfinite) == core::kLocalNonfinite * sizeof(double));
static_assert(offsetof(RankStats, local_sumsq) == core::kLocalSumsq * sizeof(double));
static_assert(offsetof(RankStats, loss) == core::kLoss * sizeof(double));
static_assert(offsetof(RankStats, stop_requested) == core::kStopRequested * sizeof(double));
static_assert(offsetof(RankStats, overflow_runs) == core::kOverflowRuns * sizeof(double));
static_assert(offsetof(RankStats, bad_samples) == core::kBadSamples * sizeof(double));
static_assert(offsetof(RankStats, compute_seconds) == core::kComputeSeconds * sizeof(double));
static_assert(sizeof(RankStats) == core::kStatsDoubles * sizeof(double));

// The core's rows of a table of stats.
inline const double* rows_of(const std::vector<RankStats>& table) {
  return reinterpret_cast<const double*>(table.data());
}

struct Verdict {
  Decision decision = Decision::kStep;
  uint32_t reasons = 0;           // core::Reason bits; kLossScaleOverflow alone for an overflow
  core::Why why = core::kNoWhy;   // what made it an abort (or an interrupted skip)
  std::string guard;              // `why` as the abort's message says it, numbers included
  core::Scope scope = core::kNoScope;
  double grad_norm = 0;           // global, unscaled, before clipping; NaN when nonfinite > 0
  double nonfinite = 0;           // global nonfinite gradient elements
  double loss = 0;                // global (mean over ranks)
  bool stop = false;              // some rank asks to stop after this step (a signal)
  bool interrupted = false;       // a stop cut some rank's step short: nothing of it lands,
                                  // nothing is counted, the run stops at the step before
  double overflow_runs = 0;
  double grad_norm_z = 0, loss_z = 0;  // NaN while the window is too short or the test is off
  std::vector<int> culprit_ranks;      // local anomalies only: the ranks that stand out
  double loss_scale = 1;               // the scale this step's gradients carry (fp16)
  bool overflow = false;               // an fp16 overflow, not bad data
  std::string cause;                   // kCause*, "" when unknown (no replay)
  std::vector<double> rank_grad_norm, rank_loss;      // each rank's own values (unscaled)
  std::vector<core::RankFinding> rank_findings;       // ... against its own windows: z-scores
                                                      // and why it stands out (anomalous steps)
  std::optional<core::RankValues> own_values;  // the record form: this rank's (its windows')
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
  bool anomalous() const { return decision != Decision::kStep || reasons != 0; }
  bool updates() const { return decision == Decision::kStep || decision == Decision::kClip ||
                                decision == Decision::kSalvage; }
};

// The core's result of a decided verdict (what record_step, record_rank and the per-tensor
// rules read).
core::DecideResult result_of(const Verdict& v);

}  // namespace lockstep
