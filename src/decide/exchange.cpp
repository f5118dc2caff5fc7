#include "decide/exchange.h"

#include <cmath>
#include <cstring>

namespace lockstep {

RankStats rank_stats(const GradCheckStats& local, const GradCheckStats& shard, double loss,
                     const std::vector<double>& sample_losses, bool stop_requested) {
  RankStats s;
  s.local_nonfinite = local.nonfinite;
  s.local_sumsq = local.sumsq;
  s.shard_nonfinite = shard.nonfinite;
  s.shard_sumsq = shard.sumsq;
  s.overflow_runs = shard.overflow_runs;
  s.loss = loss;
  s.stop_requested = stop_requested ? 1.0 : 0.0;
  for (double l : sample_losses) s.bad_samples += !std::isfinite(l);
  return s;
}

std::vector<RankStats> exchange_stats(const RankStats& mine, Comm* comm) {
  std::vector<double> values(kRankStatsDoubles);
  std::memcpy(values.data(), &mine, sizeof mine);
  const auto all = all_gather_values(comm, values);
  std::vector<RankStats> out(all.size());
  for (size_t r = 0; r < all.size(); ++r)
    std::memcpy(static_cast<void*>(&out[r]), all[r].data(), sizeof mine);
  return out;
}

SampleTable exchange_samples(const std::vector<int64_t>& ids, const std::vector<double>& losses,
                             Comm* comm) {
  const size_t n = ids.size();
  std::vector<double> mine(ids.begin(), ids.end());  // exact below 2^53
  mine.insert(mine.end(), losses.begin(), losses.end());
  SampleTable t;
  for (const auto& q : all_gather_values(comm, mine)) {
    t.ids.emplace_back(q.begin(), q.begin() + static_cast<long>(n));
    t.losses.emplace_back(q.begin() + static_cast<long>(n), q.end());
  }
  return t;
}

}  // namespace lockstep
