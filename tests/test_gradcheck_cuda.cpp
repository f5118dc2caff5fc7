// The CUDA gradient check against the CPU one and the ATen reference. Labelled `gpu` in ctest;
// every test skips cleanly where no GPU is visible.
#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <limits>
#include <utility>

#include "gradcheck_reference.h"

using namespace lockstep;
using lockstep::test::expect_matches;
using lockstep::test::random_grads;
using lockstep::test::reference_stats;

namespace {

const c10::Device kCuda(c10::kCUDA, 0);
const double kNan = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

#define SKIP_WITHOUT_GPU() \
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible"

GradCheckStats run_check(const std::vector<NamedTensor>& grads, int64_t offset = 0,
                         int64_t length = -1) {
  GradCheck check(grads, offset, length);
  return GradCheck::read(check.run());
}

std::vector<NamedTensor> to_cpu(const std::vector<NamedTensor>& g) {
  std::vector<NamedTensor> out;
  for (const auto& t : g) out.push_back({t.name, t.tensor.to(at::kCPU)});
  return out;
}

}  // namespace

TEST(GradCheckCuda, EveryDtypeWithPlantedValues) {
  SKIP_WITHOUT_GPU();
  for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
    auto grads = random_grads({0, 1, 7, 33, 1000003, (1 << 20) + 3}, dt, kCuda);
    grads[4].tensor.select(0, 0).fill_(kNan);
    grads[4].tensor.select(0, 1000002).fill_(kInf);
    grads[5].tensor.select(0, 12345).fill_(-kInf);
    auto want = reference_stats(to_cpu(grads));
    expect_matches(run_check(grads), want);
    EXPECT_EQ(run_check(grads).nonfinite, 3) << c10::toString(dt);
  }
}

TEST(GradCheckCuda, OverflowIsNotNonfinite) {
  SKIP_WITHOUT_GPU();
  at::Tensor t = at::zeros({100000}, at::TensorOptions().dtype(at::kFloat).device(kCuda));
  t.select(0, 5).fill_(1e30);
  t.select(0, 99999).fill_(-2e25);
  std::vector<NamedTensor> grads = {{"t", t}};
  auto got = run_check(grads);
  EXPECT_EQ(got.nonfinite, 0);
  EXPECT_GE(got.overflow_runs, 1);
  const double big = static_cast<float>(1e30), small = static_cast<float>(2e25);  // as stored
  EXPECT_NEAR(got.sumsq, big * big + small * small, 1e-12 * 1e60);
}

TEST(GradCheckCuda, OverflowRunsMeanTheSameAsOnTheCpu) {
  SKIP_WITHOUT_GPU();
  for (auto [dt, huge] : {std::pair{at::kFloat, 1e30}, std::pair{at::kBFloat16, 1e30},
                          std::pair{at::kDouble, 1e200}}) {
    auto grads = lockstep::test::overflow_runs_case(kCuda, dt, huge);
    const auto got = run_check(grads), cpu = run_check(to_cpu(grads));
    EXPECT_EQ(got.overflow_runs, lockstep::test::kOverflowRunsInCase) << c10::toString(dt);
    EXPECT_EQ(got.overflow_runs, cpu.overflow_runs) << c10::toString(dt);
    EXPECT_EQ(std::isfinite(got.sumsq), dt != at::kDouble) << c10::toString(dt);
  }
}

// Two streams launching the same plan back to back, unsynchronised: each launch waits for the
// previous one (the plan's event), so every result is right and the ticket stays sound after.
TEST(GradCheckCuda, OnePlanLaunchedFromTwoStreamsGivesCorrectResults) {
  SKIP_WITHOUT_GPU();
  auto grads = random_grads({1 << 22, 4097, 3}, at::kFloat, kCuda);
  grads[1].tensor.select(0, 7).fill_(kNan);
  GradCheck check(grads);
  const at::Tensor eager = check.run().clone();
  c10::cuda::CUDAStream a = c10::cuda::getStreamFromPool(), b = c10::cuda::getStreamFromPool();
  std::vector<at::Tensor> results;
  for (int i = 0; i < 20; ++i) {
    c10::cuda::CUDAStreamGuard guard(i % 2 == 0 ? a : b);
    results.push_back(check.run().clone());
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (size_t i = 0; i < results.size(); ++i)
    EXPECT_TRUE(at::equal(results[i], eager)) << "launch " << i;
  EXPECT_TRUE(at::equal(check.run(), eager)) << "a later launch";
}

TEST(GradCheckCuda, TinyTensorsShardsAndUnalignedViews) {
  SKIP_WITHOUT_GPU();
  std::vector<int64_t> sizes;
  for (int i = 0; i < 10000; ++i) sizes.push_back(i % 9);
  auto tiny = random_grads(sizes, at::kFloat, kCuda);
  tiny[9004].tensor.select(0, 2).fill_(kNan);  // 9004 % 9 = 4 elements
  expect_matches(run_check(tiny), reference_stats(to_cpu(tiny)));

  at::Tensor flat = at::randn({300001}, at::TensorOptions().dtype(at::kBFloat16).device(kCuda));
  std::vector<NamedTensor> views = {{"a", flat.narrow(0, 1, 99999)},
                                    {"b", flat.narrow(0, 100003, 150001)},
                                    {"c", flat.narrow(0, 250005, 3)}};
  auto cpu_views = to_cpu(views);
  for (int world : {1, 2, 3}) {
    const int64_t per = (99999 + 150001 + 3 + world - 1) / world;
    for (int r = 0; r < world; ++r)
      expect_matches(run_check(views, r * per, per), reference_stats(cpu_views, r * per, per));
  }
}

TEST(GradCheckCuda, SameInputSameBits) {
  SKIP_WITHOUT_GPU();
  auto grads = random_grads({50000000, 4097, 3}, at::kFloat, kCuda);
  GradCheck check(grads);
  at::Tensor a = check.run().clone();
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(at::equal(check.run(), a)) << "run " << i;
}

TEST(GradCheckCuda, CapturedInACudaGraphAndReplayed) {
  // A check that allocated, copied from the host or synced could not be captured.
  SKIP_WITHOUT_GPU();
  auto grads = random_grads({1 << 20, 333, 7}, at::kFloat, kCuda);
  grads[1].tensor.select(0, 3).fill_(kNan);
  GradCheck check(grads);
  at::Tensor eager = check.run().clone();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the eager launch ends before the capture

  c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool();
  c10::cuda::CUDAStreamGuard guard(stream);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream.stream(), cudaStreamCaptureModeThreadLocal), cudaSuccess);
  at::Tensor out = check.run();
  ASSERT_EQ(cudaStreamEndCapture(stream.stream(), &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 3; ++replay) {
    out.zero_();
    ASSERT_EQ(cudaGraphLaunch(exec, stream.stream()), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream.stream()), cudaSuccess);
    EXPECT_TRUE(at::equal(out, eager)) << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// Chunks checked early as their bucket lands (run_range: launches that only write their chunk
// results), then run() for the rest: the bits of one launch over everything, in whole tensors
// and in a shard; a range's chunks are not checked twice, and the next run() starts afresh.
TEST(GradCheckCuda, ChunksCheckedAsTheirBucketLandsGiveTheSameBits) {
  SKIP_WITHOUT_GPU();
  auto grads = random_grads({70000, 5, 200000, 1 << 17, 33}, at::kFloat, kCuda);
  grads[2].tensor.select(0, 12345).fill_(kNan);
  grads[3].tensor.select(0, 99).fill_(1e30);  // an overflow run, redone in fp64
  for (const auto& [offset, length] : {std::pair<int64_t, int64_t>{0, -1}, {50000, 250000}}) {
    SCOPED_TRACE(offset);
    GradCheck whole(grads, offset, length), parts(grads, offset, length);
    const at::Tensor want = whole.run().clone();
    parts.run_range(0, 70005);         // the first two tensors
    parts.run_range(270005, 1 << 30);  // the tail: two runs of adjacent chunks with the first
    parts.run_range(100000, 150000);   // inside a tensor: its whole chunks only
    parts.run_range(0, 70005);         // again: nothing left to check there
    EXPECT_TRUE(at::equal(parts.run(), want));
    EXPECT_GT(parts.blocks_checked_early(), 0);
    EXPECT_TRUE(at::equal(parts.run(), want));
    EXPECT_EQ(parts.blocks_checked_early(), 0);
    parts.run_range(0, 1 << 30);  // everything early: the reducing launch checks nothing
    EXPECT_TRUE(at::equal(parts.run(), want));
  }
}
