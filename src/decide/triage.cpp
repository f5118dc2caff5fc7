#include "decide/triage.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "clock.h"
#include "decide/exchange.h"
#include "log.h"

namespace lockstep {
namespace {

constexpr int kSlot = 5;  // computed (0/1), loss, local sumsq, local nonfinite, gradient CRC32

bool contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

void put(std::vector<double>& slots, size_t slot, const ReplayNumbers& n) {
  const double row[kSlot] = {1, n.loss, n.local_sumsq, n.local_nonfinite, n.gradient_crc};
  std::copy(row, row + kSlot, slots.begin() + static_cast<long>(slot * kSlot));
}

// Slot `slot` of rank `from`'s row, when it computed one.
bool take(const std::vector<std::vector<double>>& all, int from, size_t slot, ReplayNumbers& n) {
  const double* q = all[from].data() + slot * kSlot;
  if (q[0] != 1) return false;
  n = {q[1], q[2], q[3], q[4]};
  return true;
}

ReplayResult result_of(int rank, int by, bool reproduced, const ReplayNumbers& n,
                       const RankStats& first) {
  return {rank,          by,        reproduced, n.loss, n.local_sumsq, n.local_nonfinite,
          first.loss, first.local_sumsq, first.local_nonfinite};
}

// The next rank after `c` that is not a culprit, or -1.
int peer_of(int c, const std::vector<int>& culprits, int world) {
  for (int k = 1; k < world; ++k)
    if (int p = (c + k) % world; !contains(culprits, p)) return p;
  return -1;
}

std::string joined_causes(const std::vector<std::string>& causes) {
  std::vector<std::string> unique;
  for (const auto& c : causes)
    if (std::find(unique.begin(), unique.end(), c) == unique.end()) unique.push_back(c);
  std::string out;
  for (const auto& c : unique) out += (out.empty() ? "" : ", ") + c;
  return out;
}

}  // namespace

Triager::Triager(const SkipConfig& skip, int64_t replay_every, Comm* comm, int rank,
                 double tolerance)
    : cfg_(skip),
      replay_every_(replay_every),
      comm_(comm),
      rank_(rank),
      world_(comm ? comm->size() : 1),
      tolerance_(tolerance),
      active_(skip.enabled && (skip.scope == SkipScope::kRank || skip.replay != Replay::kOff)) {}

bool Triager::same(const ReplayNumbers& a, const RankStats& first) const {
  auto close = [&](double x, double y) {
    if (std::isnan(x) || std::isnan(y)) return std::isnan(x) && std::isnan(y);
    if (tolerance_ == 0) return std::memcmp(&x, &y, sizeof x) == 0;
    return x == y || std::abs(x - y) <= tolerance_ * std::max(std::abs(x), std::abs(y));
  };
  return a.local_nonfinite == first.local_nonfinite && close(a.loss, first.loss) &&
         close(a.local_sumsq, first.local_sumsq);
}

Triage Triager::before_sync(const SkipDetector& detector, const TriageInput& in,
                            const Recompute& recompute, StepCosts& costs) const {
  Triage t;
  if (!active_) return t;
  const auto start = Clock::now();
  const std::vector<RankStats> table = exchange_stats(in.mine, comm_);
  costs.triage += seconds_since(start);
  const LocalFindings f = detector.local_findings(table);
  if (!f.local(table.size())) return t;  // nothing, or global: the synced gradient decides
  t.culprits = f.outliers;
  t.reasons = f.reasons;
  std::vector<std::string> causes(t.culprits.size());
  std::vector<int> still_bad = t.culprits;
  if (cfg_.replay != Replay::kOff) {
    const SampleTable samples = exchange_samples(in.ids, in.sample_losses, comm_);
    std::vector<double> mine(t.culprits.size() * 2 * kSlot, 0.0);
    for (size_t k = 0; k < t.culprits.size(); ++k) {
      const int c = t.culprits[k];
      const int p = cfg_.replay == Replay::kPeer ? peer_of(c, t.culprits, world_) : -1;
      const auto replay_start = Clock::now();
      if (rank_ == c) put(mine, 2 * k, recompute(c, samples.ids[c], /*keep=*/true));
      if (rank_ == p) put(mine, 2 * k + 1, recompute(c, samples.ids[c], /*keep=*/false));
      if (rank_ != c && rank_ != p && bystand_) bystand_();
      costs.replay += seconds_since(replay_start);
    }
    const auto all = all_gather_values(comm_, mine);
    still_bad.clear();
    for (size_t k = 0; k < t.culprits.size(); ++k) {
      const int c = t.culprits[k];
      const int p = cfg_.replay == Replay::kPeer ? peer_of(c, t.culprits, world_) : -1;
      ReplayNumbers self, peer;
      take(all, c, 2 * k, self);
      const bool self_same = same(self, table[c]);
      t.replays.push_back(result_of(c, c, self_same, self, table[c]));
      causes[k] = self_same ? kCauseData : kCauseTransient;
      if (self_same && p >= 0 && take(all, p, 2 * k + 1, peer)) {
        const bool peer_same = same(peer, table[c]);
        t.replays.push_back(result_of(c, p, peer_same, peer, table[c]));
        if (!peer_same) causes[k] = kCauseHardware;
      }
      if (causes[k] != kCauseTransient) still_bad.push_back(c);
      if (causes[k] != kCauseData) t.hardware_suspects.push_back(c);
    }
    t.cause = joined_causes(causes);
  }
  if (still_bad.empty()) return t;  // every culprit repaired by its replay
  const bool may_drop = cfg_.scope == SkipScope::kRank &&
                        static_cast<double>(still_bad.size()) <=
                            cfg_.max_dropped_fraction * static_cast<double>(world_);
  if (may_drop) {
    t.dropped = still_bad;
  } else {
    t.skip_step = true;
    if (cfg_.scope == SkipScope::kRank)  // say why this is a skip, not a salvage
      log::warn_shared("skip.scope = \"rank\": dropping rank{} {} would leave out {} of {} "
                       "ranks, above skip.max_dropped_fraction = {:g}: the step is skipped, not "
                       "salvaged; raise skip.max_dropped_fraction to salvage such steps",
                       still_bad.size() > 1 ? "s" : "", fmt::join(still_bad, ", "),
                       still_bad.size(), world_, cfg_.max_dropped_fraction);
  }
  return t;
}

void Triager::probe(int64_t step, const std::vector<RankStats>& table, const TriageInput& in,
                    const Recompute& recompute, Triage& t, StepCosts& costs) const {
  if (replay_every_ <= 0 || world_ < 2 || step % replay_every_ != 0) return;
  const int prober = static_cast<int>((step / replay_every_) % world_);
  const int target = (prober + 1) % world_;
  const SampleTable samples = exchange_samples(in.ids, in.sample_losses, comm_);
  std::vector<double> mine(2 * kSlot, 0.0);  // the prober's replay; the target's own CRC32
  const auto start = Clock::now();
  if (rank_ == prober) put(mine, 0, recompute(target, samples.ids[target], /*keep=*/false));
  else if (bystand_) bystand_();
  if (rank_ == target) put(mine, 1, {in.mine.loss, in.mine.local_sumsq, in.mine.local_nonfinite,
                                     in.gradient_crc});
  costs.replay += seconds_since(start);
  const auto all = all_gather_values(comm_, mine);
  ReplayNumbers n, first;
  take(all, prober, 0, n);
  take(all, target, 1, first);
  const bool exact = tolerance_ == 0 && n.gradient_crc >= 0 && first.gradient_crc >= 0;
  const bool reproduced =
      same(n, table[target]) && (!exact || n.gradient_crc == first.gradient_crc);
  t.replays.push_back(result_of(target, prober, reproduced, n, table[target]));
  if (reproduced || contains(t.culprits, target)) return;
  t.culprits.push_back(target);
  std::sort(t.culprits.begin(), t.culprits.end());
  t.reasons |= core::kReplayMismatch;
  t.hardware_suspects.push_back(target);
  t.cause = t.cause.empty() ? kCauseHardware : joined_causes({t.cause, kCauseHardware});
  t.skip_step = true;  // the synced gradient holds a contribution no one can vouch for
}

}  // namespace lockstep
