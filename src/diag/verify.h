// diagnostics.verify_every: all ranks compare CRC32s of what they must hold identically (the
// parameters, and ddp's replicated optimizer state); the ranks that differ from the majority
// have diverged (nondeterminism, a memory error, a bug) and the job stops naming them. With no
// majority (two ranks, or a tie) every rank disagrees and none is named, unless replays or
// probes earlier in the run blamed exactly one of them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.h"
#include "diag/event.h"
#include "fault.h"
#include "tensors.h"

namespace lockstep {

struct ReplicaVote {
  std::vector<int> diverged;  // ranks that differ from the majority (empty: all agree)
  bool no_majority = false;   // the largest group ties with another: `diverged` is every rank
  std::vector<std::pair<std::string, std::string>> crcs;  // per rank: params, optimizer ("%08x")
};

// One all-gather of two CRC32s per rank; ties go to the smaller CRC pair, the same everywhere.
ReplicaVote vote_replicas(const std::vector<NamedTensor>& params,
                          const std::vector<NamedTensor>& optimizer_state, Comm* comm);

// The event and the one-line message of a desync found at step `step`; `last_verified` is the
// last step all ranks agreed.
// `suspects`: the ranks whose device a replay or probe blamed so far, with the steps.
using DeviceSuspects = std::map<int, std::vector<int64_t>>;
Event desync_event(int64_t step, int rank, FaultKind fault, const ReplicaVote& vote,
                   const DeviceSuspects& suspects);
std::string desync_message(int64_t step, int64_t last_verified, const ReplicaVote& vote,
                           const DeviceSuspects& suspects);

}  // namespace lockstep
