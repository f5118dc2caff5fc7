// The numbers the decision is made from, and how every rank comes to hold all of them: one
// all-gather of each rank's 72-byte RankStats per step (every rank then reduces the table in
// rank order, so all reach the same verdict by construction), and on anomalous steps only a
// second one of the sample ids and per-sample losses, for the diagnostics.
#pragma once

#include <cstdint>
#include <vector>

#include "check/gradcheck.h"
#include "comm/comm.h"
#include "decide/verdict.h"

namespace lockstep {

// This rank's contribution: its checks [A] (zeros when off) and [B], its loss and samples.
RankStats rank_stats(const GradCheckStats& local, const GradCheckStats& shard, double loss,
                     const std::vector<double>& sample_losses, bool stop_requested);

// The same row built where the tensors live, with no host sync: the checks' stats buffers
// (GradCheck::run(); `local` undefined when check [A] is off), the loss (0-dim) and every
// sample's loss, all fp64 on one device. Bit for bit the numbers rank_stats gives.
// `stop`: RankStats::stop_requested (0, 1: stop after this step, 2: the step was cut short);
// `compute_seconds`: RankStats::compute_seconds.
at::Tensor rank_row(const at::Tensor& local, const at::Tensor& shard, const at::Tensor& loss,
                    const at::Tensor& sample_losses, double stop, double compute_seconds = 0);

// Every rank's stats, in rank order (a null comm is one rank alone): from this rank's stats on
// the host, or from its row on the device (one all-gather, one read of the table).
std::vector<RankStats> exchange_stats(const RankStats& mine, Comm* comm);
std::vector<RankStats> exchange_stats(const at::Tensor& row, Comm* comm);
// The rows of a gathered [W, 9] fp64 table in host memory.
std::vector<RankStats> stats_of(const at::Tensor& host_table);
// Whether every rank measured its compute time (RankStats::compute_seconds > 0; the straggler
// watch leaves a step out otherwise).
bool all_measured(const std::vector<RankStats>& table);

// Per rank: the sample ids of its batch and their losses.
struct SampleTable {
  std::vector<std::vector<int64_t>> ids;
  std::vector<std::vector<double>> losses;
};
SampleTable exchange_samples(const std::vector<int64_t>& ids, const std::vector<double>& losses,
                             Comm* comm);

}  // namespace lockstep
