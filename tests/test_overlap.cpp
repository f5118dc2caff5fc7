// parallelism.overlap: buckets of gradients sent while backward still runs, with the same
// results as the sync after backward, in ddp and sharded mode; check [B] of each bucket as it
// lands.
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <gtest/gtest.h>

#include "check/gradcheck.h"
#include "comm_util.h"
#include "lockstep/error.h"
#include "parallel/data_parallel.h"
#include "run_util.h"

using namespace lockstep;

namespace {

constexpr int64_t kN = 1000;  // elements per parameter

// Three parameters used in a chain: autograd finishes c's gradient first and a's last.
struct Chain {
  std::vector<NamedTensor> params;
  Chain() {
    for (int i = 0; i < 3; ++i)
      params.push_back({std::string(1, static_cast<char>('a' + i)),
                        at::full({kN}, 1.0 + 0.25 * i, at::kFloat).requires_grad_(true)});
  }
  const at::Tensor& operator[](int i) const { return params[i].tensor; }
  // Micro-batch `micro` of rank `rank`: different data, so different gradients, on every rank.
  at::Tensor loss(int rank, int micro) const {
    const at::Tensor x = at::arange(kN, at::kFloat).mul(1e-3 * (rank + 1) + 0.37 * micro);
    return x.mul((*this)[0]).tanh().mul((*this)[1]).sin().mul((*this)[2]).sum();
  }
};

// The synced gradient this rank checks and updates (its shard), flat.
at::Tensor synced_shard(const DataParallel& dp) {
  std::vector<at::Tensor> flat;
  for (const auto& g : dp.synced_grads()) flat.push_back(g.tensor.reshape({-1}));
  return at::cat(flat).narrow(0, dp.shard_offset(), dp.shard_length()).clone();
}

// Two micro-batches and the sync, overlapped or not; `during` receives how many buckets had
// started when autograd began a's gradient (the last one it computes).
at::Tensor train_step(Comm& comm, ParallelMode mode, bool overlap, int* during = nullptr,
                      at::Tensor* local = nullptr) {
  Chain chain;
  DataParallelOptions o;
  o.mode = mode;
  o.overlap = overlap;
  o.bucket_bytes = kN * 4 * (mode == ParallelMode::kSharded ? comm.size() : 1) / 2;
  auto dp = make_data_parallel(chain.params, &comm, o);
  if (overlap) {
    EXPECT_NE(dp->buckets(), nullptr);
  }
  if (during)
    chain[0].register_hook([&dp, during](const at::Tensor&) {
      *during = dp->buckets() ? dp->buckets()->started_during_backward() : -1;
    });
  for (int micro = 0; micro < 2; ++micro) {
    if (micro == 1) dp->begin_last_backward();
    chain.loss(comm.rank(), micro).backward();
  }
  if (local) {
    std::vector<at::Tensor> flat;
    for (const auto& g : dp->grads()) flat.push_back(g.tensor.reshape({-1}));
    *local = at::cat(flat).clone();
  }
  dp->sync_gradients(comm.size());
  return synced_shard(*dp);
}

// This rank's two micro-batches' gradient, by autograd alone.
at::Tensor plain_gradient(int rank) {
  Chain chain;
  for (int micro = 0; micro < 2; ++micro) chain.loss(rank, micro).backward();
  return at::cat({chain[0].grad(), chain[1].grad(), chain[2].grad()});
}

// Check [B] run as the sync lands (each ddp bucket, each slice of a sharded block, overlapped
// or not) and run again in one pass over the same synced shard afterwards.
struct CheckedStep {
  at::Tensor as_landed, once;
  int64_t checked_early = 0;
};

CheckedStep checked_step(Comm& comm, ParallelMode mode, bool overlap) {
  Chain chain;
  DataParallelOptions o;
  o.mode = mode;
  o.overlap = overlap;
  // A parameter per ddp bucket; a parameter's length of every rank's block per sharded slice.
  o.bucket_bytes = kN * 4 * (mode == ParallelMode::kSharded ? comm.size() : 1);
  auto dp = make_data_parallel(chain.params, &comm, o);
  GradCheck check(dp->synced_grads(), dp->shard_offset(), dp->shard_length());
  dp->on_landed([&check](int64_t lo, int64_t hi) { check.run_range(lo, hi); });
  for (int micro = 0; micro < 2; ++micro) {
    if (micro == 1) dp->begin_last_backward();
    chain.loss(comm.rank(), micro).backward();
  }
  dp->sync_gradients(comm.size());
  CheckedStep r;
  r.as_landed = check.run().clone();
  r.checked_early = check.blocks_checked_early();
  r.once = GradCheck(dp->synced_grads(), dp->shard_offset(), dp->shard_length()).run().clone();
  return r;
}

}  // namespace

TEST(Overlap, BucketsStartDuringBackwardAndSumAsTheSyncAfterIt) {
  for (int world : {2, 3})
    for (ParallelMode mode : {ParallelMode::kDdp, ParallelMode::kSharded})
      test::on_ranks(world, [mode](Comm& comm) {
        const std::string what = std::string(mode == ParallelMode::kDdp ? "ddp" : "sharded") +
                                 " on " + std::to_string(comm.size()) + " ranks";
        const at::Tensor after = train_step(comm, mode, false);
        int during = 0;
        at::Tensor local;
        const at::Tensor overlapped = train_step(comm, mode, true, &during, &local);
        // Before autograd even began a's gradient, ddp had sent c's and b's buckets (one
        // parameter each). A sharded call sends a slice of every rank's block: on 2 ranks
        // (blocks a|b and b|c, slices of half a parameter) the slice of b's end and c's end
        // had gone; on 3 ranks every slice holds a piece of a, so all wait for it.
        const int sent = mode == ParallelMode::kDdp ? 2 : comm.size() == 2 ? 1 : 0;
        EXPECT_EQ(during, sent) << what;
        EXPECT_TRUE(at::equal(overlapped, after)) << what << ": the synced shard differs";
        // The local gradient [A] reads is untouched by the sync in flight (ddp reduces into a
        // buffer of its own; sharded reads it and writes its block after the check).
        if (mode == ParallelMode::kDdp) {
          EXPECT_TRUE(at::equal(local, plain_gradient(comm.rank()))) << what;
        }
      });
}

// Check [B] of each bucket or slice runs as soon as it has landed, mean taken: some of its
// blocks are checked before the last collective's wait, and the stats are those of one pass
// over the final synced shard, bit for bit (a block checked before its values landed would
// differ).
TEST(Overlap, ChecksRunAsBucketsLandGiveTheBitsOfOnePass) {
  for (int world : {2, 3})
    for (ParallelMode mode : {ParallelMode::kDdp, ParallelMode::kSharded})
      for (bool overlap : {false, true})
        test::on_ranks(world, [mode, overlap](Comm& comm) {
          const std::string what = std::string(mode == ParallelMode::kDdp ? "ddp" : "sharded") +
                                   (overlap ? ", overlapped," : "") + " on rank " +
                                   std::to_string(comm.rank()) + " of " +
                                   std::to_string(comm.size());
          const CheckedStep r = checked_step(comm, mode, overlap);
          EXPECT_GT(r.checked_early, 0) << what;
          EXPECT_TRUE(at::equal(r.as_landed, r.once)) << what;
        });
}

TEST(Overlap, TrainingEqualsTheSyncAfterBackwardBitForBit) {
  test::TempDir dir;
  // Accumulation (hooks act on the last micro-batch only), a skipped step, small buckets; and
  // bf16 compute with fp32 reduction (each bucket is cast as it goes).
  const std::string common =
      "--training.gradient_accumulation_steps 2 --parallelism.bucket_mb 0.004 "
      "--fault.inject 'nan_grad@4:1' --skip.min_history 3 ";
  struct Case {
    int world;
    std::string mode, extra;
  };
  for (const Case& c : {Case{2, "ddp", ""}, Case{2, "sharded", ""},
                        Case{3, "ddp", "--training.mixed_precision_param bfloat16"},
                        Case{3, "sharded", "--training.mixed_precision_param bfloat16"}}) {
    const std::string what = c.mode + " on " + std::to_string(c.world) + " ranks " + c.extra;
    std::vector<test::RunOutcome> runs;
    std::vector<std::vector<std::string>> decisions;
    for (const char* overlap : {"false", "true"}) {
      const std::string run = dir / (c.mode + std::to_string(c.world) + overlap);
      const test::CliRun r = test::run_ranks(c.world, run, 8,
                                       common + c.extra + " --parallelism.mode " + c.mode +
                                           " --parallelism.overlap " + overlap);
      ASSERT_EQ(r.code, 0) << what << "\n" << r.out;
      runs.push_back(test::outcome(run, c.world));
      decisions.push_back(test::decisions(run, 0));
    }
    EXPECT_EQ(runs[1].crcs, runs[0].crcs) << what << ": the weights differ";
    EXPECT_EQ(runs[1].losses, runs[0].losses) << what;
    EXPECT_EQ(decisions[1], decisions[0]) << what;
    ASSERT_EQ(decisions[0].size(), 1u) << what << ": the injected fault was not skipped";
  }
}

TEST(Overlap, WhatActsBeforeTheSyncIsRefusedNamingBothKeys) {
  const std::vector<std::vector<Override>> refused = {
      {{"skip.replay", "peer"}},
      {{"skip.scope", "rank"}},
      {{"diagnostics.replay_every", "10"}},
      {{"fault.inject", "transient_nan@3:0"}},
      {{"fault.random_p", "0.1"}, {"fault.random_kinds", "nan_grad, sticky_flip"}}};
  for (const auto& extra : refused) {
    auto ov = extra;
    ov.push_back({"parallelism.overlap", "true"});
    try {
      test::job("/tmp/unused", 4, ov);
      ADD_FAILURE() << extra[0].first << " was accepted with overlap";
    } catch (const ConfigError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("'parallelism.overlap'"), std::string::npos) << m;
      EXPECT_NE(m.find("set parallelism.overlap = false"), std::string::npos) << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    }
    test::job("/tmp/unused", 4, extra);  // fine without overlap
  }
  test::job("/tmp/unused", 4, {{"parallelism.overlap", "true"}, {"fault.inject", "nan_grad@3:0"}});
}
