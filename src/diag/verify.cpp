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
    if (it->second > majority->second) majority = it;  // ties: the smaller CRC pair, everywhere
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r] != majority->first) vote.diverged.push_back(static_cast<int>(r));
  return vote;
}

Event desync_event(int64_t step, int rank, FaultKind fault, const ReplicaVote& vote) {
  Event e;
  e.step = step;
  e.decision = "abort";
  e.reasons = {"desync"};
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
  e.counters.step = step;
  return e;
}

std::string desync_message(int64_t step, int64_t last_verified, const ReplicaVote& vote) {
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
