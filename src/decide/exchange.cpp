#include "decide/exchange.h"

#include <ATen/ops/empty.h>

#include <cstring>

namespace lockstep {

std::vector<RankStats> exchange_stats(const at::Tensor& row, Comm* comm) {
  return stats_of(all_gather_rows(comm, row));  // [W, 9] fp64 on the host
}

std::vector<RankStats> exchange_stats(const RankStats& mine, Comm* comm) {
  at::Tensor row = at::empty({kRankStatsDoubles}, at::kDouble);
  std::memcpy(row.data_ptr<double>(), &mine, sizeof mine);
  return exchange_stats(row, comm);
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
