// This rank's 72-byte row and the table of every rank's, without collectives (exchange.h): the
// PyTorch package builds the same row (cmake/package_sources.txt), so its layout exists once.
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "decide/exchange.h"

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

at::Tensor rank_row(const at::Tensor& local, const at::Tensor& shard, const at::Tensor& loss,
                    const at::Tensor& sample_losses, double stop, double compute_seconds) {
  const auto o = shard.options();
  const at::Tensor own = local.defined() ? local.narrow(0, 0, 2) : at::zeros({2}, o);
  const at::Tensor bad = at::isfinite(sample_losses).logical_not().sum().to(at::kDouble);
  // Each field where the core's row puts it (core::StatsField); the stats buffers hold
  // nonfinite, sumsq, overflow runs, ...
  std::vector<at::Tensor> f(core::kStatsDoubles);
  f[core::kShardNonfinite] = shard.narrow(0, 0, 1);
  f[core::kShardSumsq] = shard.narrow(0, 1, 1);
  f[core::kLocalNonfinite] = own.narrow(0, 0, 1);
  f[core::kLocalSumsq] = own.narrow(0, 1, 1);
  f[core::kLoss] = loss.reshape({1});
  f[core::kStopRequested] = at::full({1}, stop, o);
  f[core::kOverflowRuns] = shard.narrow(0, 2, 1);
  f[core::kBadSamples] = bad.reshape({1});
  f[core::kComputeSeconds] = at::full({1}, compute_seconds, o);
  return at::cat(f);
}

bool all_measured(const std::vector<RankStats>& table) {
  return std::all_of(table.begin(), table.end(),
                     [](const RankStats& r) { return r.compute_seconds > 0; });
}

std::vector<RankStats> stats_of(const at::Tensor& table) {
  std::vector<RankStats> out(static_cast<size_t>(table.size(0)));
  for (size_t r = 0; r < out.size(); ++r)
    std::memcpy(static_cast<void*>(&out[r]),
                table.select(0, static_cast<int64_t>(r)).data_ptr<double>(), sizeof(RankStats));
  return out;
}

}  // namespace lockstep
