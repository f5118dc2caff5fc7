// Triage before the gradient sync (skip.scope = "rank" or skip.replay != "off"), and the
// silent-corruption probe after it (diagnostics.replay_every). Both recompute a rank's batch
// and compare; every rank learns every result from one small all-gather, so all reach the same
// cause by construction.
//
//   1. one all-gather of every rank's own stats [A] (RankStats, 72 bytes per rank): every rank
//      finds the same local outliers against the same per-rank windows (scope.cpp);
//   2. replay (skip.replay): each culprit recomputes its batch (same micro-batches, data faults
//      and dropout masks) and compares with its first computation; with "peer" the next
//      non-culprit rank recomputes it too, on its own device. Causes:
//        self differs                       -> transient_fault: the recomputed gradient is the
//                                              one synced (it is the batch's true gradient)
//        self reproduces, peer reproduces   -> data (quarantine its outlying samples)
//        self reproduces, peer differs      -> hardware (the culprit's device is suspect)
//        self reproduces, no peer ("self")  -> data (a sticky device fault looks the same:
//                                              only "peer" tells them apart)
//   3. scope = "rank": the culprits whose gradient stays bad contribute zero and the sync
//      averages over the others (at most skip.max_dropped_fraction of the ranks, else the
//      whole step is skipped); scope = "step": the step is skipped.
#pragma once

#include <functional>
#include <vector>

#include "comm/comm.h"
#include "decide/detector.h"

namespace lockstep {

// What a recomputation gave: the batch's loss, its local gradient check [A] and the CRC32 of
// that gradient's bytes (-1: not taken).
struct ReplayNumbers {
  double loss = 0, local_sumsq = 0, local_nonfinite = 0, gradient_crc = -1;
};

// Recomputes the batch of `batch_rank` at this step (its sample ids `ids`) on this rank.
// keep = true: the recomputed gradient stays in this rank's buffer (a culprit's own replay);
// false: this rank's own gradient is restored afterwards (a peer's replay, the probe).
using Recompute =
    std::function<ReplayNumbers(int batch_rank, const std::vector<int64_t>& ids, bool keep)>;

// This rank's part of a step as the triage sees it.
struct TriageInput {
  RankStats mine;  // [A] and the loss (the shard fields are not known yet)
  std::vector<int64_t> ids;
  std::vector<double> sample_losses;
  double gradient_crc = -1;  // RankStep::gradient_crc: the first computation's, before the sync
};

class Triager {
 public:
  // `tolerance`: relative difference a replay may show and still reproduce (0 on the CPU:
  // bit for bit; GPU kernels may reduce in another order).
  Triager(const SkipConfig& skip, int64_t replay_every, Comm* comm, int rank, double tolerance);

  // What a rank runs while others recompute a batch and it does not: the collectives of their
  // computation (fsdp gathers each unit's parameters with every rank). Nothing by default.
  void set_bystander(std::function<void()> bystand) { bystand_ = std::move(bystand); }

  // Whether the pre-sync exchange runs every step.
  bool active() const { return active_; }
  // Whether step `step` (1-based) reads this rank's numbers on the host: the pre-sync exchange
  // or a probe.
  bool needs_input(int64_t step) const {
    return active_ || (replay_every_ > 0 && world_ >= 2 && step % replay_every_ == 0);
  }
  // Steps 1, 2 and 3 above. Empty (and no collective) when not active. Adds what the extra
  // all-gather took to costs.triage, the recomputations to costs.replay.
  Triage before_sync(const SkipDetector& detector, const TriageInput& in,
                     const Recompute& recompute, StepCosts& costs) const;

  // The probe at 1-based `step`: every replay_every steps rank (step / replay_every) mod W
  // recomputes the batch of the next rank and compares with that rank's numbers in `table`
  // (after the sync), and on the CPU (tolerance 0) the CRC32 of the two gradients' bytes too,
  // so a single flipped bit is a difference (a sum of squares can round it away). A difference
  // skips the step and names the batch's rank as a hardware suspect. Merges into `triage`; a
  // collective on probe steps only.
  void probe(int64_t step, const std::vector<RankStats>& table, const TriageInput& in,
             const Recompute& recompute, Triage& triage, StepCosts& costs) const;

 private:
  bool same(const ReplayNumbers& a, const RankStats& first) const;
  std::function<void()> bystand_;

  SkipConfig cfg_;
  int64_t replay_every_;
  Comm* comm_;
  int rank_, world_;
  double tolerance_;
  bool active_;
};

}  // namespace lockstep
