#include "diag/verify.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "checkpoint/safetensors.h"

namespace lockstep {

ReplicaVote vote_replicas(const std::vector<NamedTensor>& params,
                          const std::vector<NamedTensor>& optimizer_state, Comm* comm) {
  // A CRC32 is exact in a double.
  const auto all =
      all_gather_values(comm, {static_cast<double>(tensors_crc32_value(params)),
                               static_cast<double>(tensors_crc32_value(optimizer_state))});
  ReplicaVote vote;
  std::map<std::vector<double>, int> votes;
  for (const auto& q : all) {
    votes[q] += 1;
    vote.crcs.emplace_back(fmt::format("{:08x}", static_cast<uint32_t>(q[0])),
                           fmt::format("{:08x}", static_cast<uint32_t>(q[1])));
  }
  auto majority = votes.begin();
  for (auto it = votes.begin(); it != votes.end(); ++it)
    if (it->second > majority->second) majority = it;
  for (const auto& [crcs, n] : votes)
    vote.no_majority = vote.no_majority || (crcs != majority->first && n == majority->second);
  for (size_t r = 0; r < all.size(); ++r)
    if (vote.no_majority || all[r] != majority->first) vote.diverged.push_back(static_cast<int>(r));
  if (votes.size() == 1) vote.diverged.clear();
  return vote;
}

namespace {

// The one disagreeing rank a replay or probe blamed, or -1.
int blamed(const ReplicaVote& vote, const DeviceSuspects& suspects) {
  int found = -1;
  for (int r : vote.diverged)
    if (suspects.count(r)) {
      if (found >= 0) return -1;
      found = r;
    }
  return found;
}

}  // namespace

Event desync_event(int64_t step, int rank, FaultKind fault, const ReplicaVote& vote,
                   const DeviceSuspects& suspects) {
  Event e;
  e.step = step;
  e.decision = Decision::kAbort;
  e.reasons = core::kDesync;
  e.guard = "diagnostics.verify_every";
  e.rank = rank;
  e.local.fault = fault_name(fault);
  for (size_t r = 0; r < vote.crcs.size(); ++r) {
    Event::RankRow row;
    row.rank = static_cast<int>(r);
    row.has_stats = false;
    row.params_crc32 = vote.crcs[r].first;
    row.optimizer_crc32 = vote.crcs[r].second;
    e.ranks.push_back(row);
  }
  e.culprit_ranks = vote.diverged;
  if (vote.no_majority) {
    const int b = blamed(vote, suspects);
    e.culprit_ranks = b >= 0 ? std::vector<int>{b} : std::vector<int>{};
  }
  e.counters.step = step;
  return e;
}

std::string desync_message(int64_t step, int64_t last_verified, const ReplicaVote& vote,
                           const DeviceSuspects& suspects) {
  if (vote.no_majority) {
    std::vector<std::string> crcs;
    for (int r : vote.diverged) crcs.push_back(vote.crcs[r].first);
    const int b = blamed(vote, suspects);
    return fmt::format(
        "step {}: desync: ranks {} disagree (params crc32 {}) and no majority of {} ranks says "
        "which diverged{}; the job stops without saving; the last step verified consistent is "
        "{}: resume from a checkpoint at or before it, and look for nondeterminism or memory "
        "errors",
        step, fmt::join(vote.diverged, ", "), fmt::join(crcs, " vs "), vote.crcs.size(),
        b < 0 ? std::string()
              : fmt::format("; rank {} is the likely one: a replay or probe blamed its device "
                            "at step {}",
                            b, fmt::join(suspects.at(b), ", ")),
        last_verified);
  }
  // The first rank not among the diverged (there is one: the majority).
  size_t agreeing = 0;
  while (std::find(vote.diverged.begin(), vote.diverged.end(), static_cast<int>(agreeing)) !=
         vote.diverged.end())
    ++agreeing;
  return fmt::format(
      "step {}: desync: rank(s) {} hold other parameters or optimizer state than the majority "
      "(params crc32 {} vs {}); the ranks no longer train one model, so the job stops without "
      "saving; the last step verified consistent is {}: resume from a checkpoint at or before "
      "it, and look for nondeterminism or memory errors on those ranks",
      step, fmt::join(vote.diverged, ", "), vote.crcs[vote.diverged[0]].first,
      vote.crcs[agreeing].first, last_verified);
}

}  // namespace lockstep
