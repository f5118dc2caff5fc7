// The computation of one rank's batch: forward and backward over its micro-batches, with the
// faults where bad data or a bad device act, and its local check [A]; and the same batch again
// for a replay (skip.replay, diagnostics.replay_every): the same samples, data faults and
// dropout masks (seeded per step, batch rank and micro-batch), on whichever rank recomputes it.
#pragma once

#include <cstdint>

#include "decide/triage.h"
#include "diag/explain.h"
#include "job.h"

namespace lockstep {

// Computation 0 of 1-based step `step`: this rank's next batch from the sampler. Gradients
// accumulate in .grad (times the loss scale, fp16); losses and samples go into `s`.
void forward_backward(Job& job, RankStep& s, int64_t step);

// Check [A]: this rank's own gradient before the sync, into s.local_stats (on the device;
// diagnostics.local_check).
void check_local(Job& job, RankStep& s);

// While another rank recomputes a batch (a replay, the probe): the collectives of its
// computation, micro-batch by micro-batch (fsdp's gathers; nothing in the other modes).
void bystand(Job& job);

// Reads what `s` holds on the device into its host fields (loss, sample losses, the checks'
// stats), each once: a host sync on a GPU, so only the triage, replays and anomalous steps call
// it.
void read_to_host(RankStep& s);

// What the triage and the probe read of this rank's step (on the host: only when they run).
TriageInput triage_input(const Job& job, RankStep& s, int64_t step);

// The Recompute the triage and the probe call at step `step`. A kept replay (a culprit's own)
// replaces s's loss, sample losses and check [A] with the recomputed ones.
Recompute replayer(Job& job, RankStep& s, int64_t step);

}  // namespace lockstep
