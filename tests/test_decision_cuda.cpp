// The decision's shared core as the device kernel (kernels/decision.cu) against the
// same code on the host: every number, the outcome, found_inf, grad_scale, and the windows,
// guards and loss scale each step advances, bit for bit; an abort stays sticky on the device.
// Labelled `gpu`. LOCKSTEP_TEST_STEPS shortens the runs (launch/gpu_check.sh's sanitizers: the
// bits are still compared, the counts of each path are not).
#include <ATen/Context.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "detector_util.h"
#include "kernels/decision.h"

using namespace lockstep;

namespace {

void ok(cudaError_t e) { ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e); }

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Steps per run: 3000, or LOCKSTEP_TEST_STEPS.
int steps_per_run() {
  const char* env = std::getenv("LOCKSTEP_TEST_STEPS");
  return env ? std::atoi(env) : 3000;
}

// Field by field (the struct's padding is not written by the kernel).
bool same(const kernels::DecideResult& a, const kernels::DecideResult& b) {
  return same_bits(a.grad_norm, b.grad_norm) && same_bits(a.loss, b.loss) &&
         same_bits(a.grad_norm_z, b.grad_norm_z) && same_bits(a.loss_z, b.loss_z) &&
         same_bits(a.clip, b.clip) && same_bits(a.loss_scale, b.loss_scale) &&
         same_bits(a.clip_to, b.clip_to) && a.reasons == b.reasons && a.outcome == b.outcome &&
         a.why == b.why && a.overflow == b.overflow && a.clipped == b.clipped &&
         a.salvaged == b.salvaged && a.stop == b.stop && a.skips_in_window == b.skips_in_window &&
         same_bits(a.nonfinite, b.nonfinite) && same_bits(a.overflow_runs, b.overflow_runs);
}

double* device_doubles(size_t n) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(double)), cudaSuccess);
  return static_cast<double*>(p);
}

constexpr int64_t kWindow = 32, kFractionWindow = 20;

struct Counts {
  int skips = 0, clips = 0, aborts = 0;
};

// 3000 random steps of `world` ranks under `on_global_spike`, decided by the kernel and by the
// same code on the host: the same result, flags and state (every window, every rank's own
// included), step by step.
Counts expect_kernel_is_host(int world, int32_t on_global_spike) {
  kernels::DecideConfig config{{true, 40, 6, 6}, 8, 1.0, {true, true, 2, 0.5, 7}, 20, 128,
                               2, 0.1, kFractionWindow};
  config.on_global_spike = on_global_spike;
  const int64_t ring_doubles = kernels::decide_state_doubles(kWindow, kFractionWindow, world);
  double* rings = device_doubles(ring_doubles);
  double* table = device_doubles(world * kernels::kStatsDoubles);
  void* p = nullptr;
  ok(cudaMalloc(&p, sizeof(kernels::DecideState)));
  auto* dev = static_cast<kernels::DecideState*>(p);
  ok(cudaMalloc(&p, sizeof(kernels::DecideResult)));
  auto* result = static_cast<kernels::DecideResult*>(p);
  ok(cudaMalloc(&p, 2 * sizeof(float)));
  auto* flags = static_cast<float*>(p);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  std::vector<double> host_rings;
  kernels::DecideState host{};
  const auto restart = [&] {  // a fresh state on the host and its twin on the device
    host_rings.assign(ring_doubles, 0.0);
    host = kernels::fresh_decide_state(host_rings.data(), kWindow, kFractionWindow, world, 1024);
    const kernels::DecideState d =
        kernels::fresh_decide_state(rings, kWindow, kFractionWindow, world, 1024);
    ok(cudaMemcpy(dev, &d, sizeof d, cudaMemcpyHostToDevice));
    ok(cudaMemcpy(rings, host_rings.data(), host_rings.size() * sizeof(double),
                  cudaMemcpyHostToDevice));
  };
  restart();

  std::mt19937_64 rng(7);
  Counts n;
  for (int step = 1; step <= steps_per_run() && !::testing::Test::HasFailure(); ++step) {
    const auto t = test::random_step(rng, world, host.scale.scale);
    std::vector<double> flat(t.size() * kernels::kStatsDoubles);
    std::memcpy(flat.data(), t.data(), flat.size() * sizeof(double));
    ok(cudaMemcpy(table, flat.data(), flat.size() * sizeof(double), cudaMemcpyHostToDevice));
    kernels::DecideResult want{}, got{};
    float want_flags[2], got_flags[2];
    kernels::decide_step(flat.data(), world, host, config, want, &want_flags[0], &want_flags[1]);
    EXPECT_EQ(kernels::launch_decide_step(table, world, dev, config, result, flags, flags + 1,
                                          stream),
              0);
    ok(cudaStreamSynchronize(stream));
    ok(cudaMemcpy(&got, result, sizeof got, cudaMemcpyDeviceToHost));
    ok(cudaMemcpy(got_flags, flags, sizeof got_flags, cudaMemcpyDeviceToHost));
    EXPECT_TRUE(same(got, want)) << "step " << step;
    EXPECT_EQ(std::memcmp(got_flags, want_flags, sizeof got_flags), 0) << "step " << step;
    std::vector<double> dev_rings(host_rings.size());
    ok(cudaMemcpy(dev_rings.data(), rings, dev_rings.size() * sizeof(double),
                  cudaMemcpyDeviceToHost));
    EXPECT_EQ(dev_rings, host_rings) << "step " << step;
    n.skips += want.outcome == kernels::kSkipStep;
    n.clips += want.clipped;
    if (want.outcome == kernels::kAbortRun) {
      ++n.aborts;
      restart();
    }
  }
  for (void* q : {static_cast<void*>(rings), static_cast<void*>(table), static_cast<void*>(dev),
                  static_cast<void*>(result), static_cast<void*>(flags)})
    cudaFree(q);
  return n;
}

}  // namespace

// 4 ranks (one warp) and 40 (two warps record the ranks' windows), each policy.
TEST(DecisionCoreCuda, TheKernelComputesTheHostsBits) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  for (int world : {4, 40}) {
    SCOPED_TRACE(std::to_string(world) + " ranks");
    const Counts clip = expect_kernel_is_host(world, kernels::kSpikeClip);
    const Counts abort = expect_kernel_is_host(world, kernels::kSpikeAbort);
    const Counts skip = expect_kernel_is_host(world, kernels::kSpikeSkip);
    if (steps_per_run() < 3000) continue;  // shortened: every path need not have been taken
    EXPECT_GT(clip.skips, 50);
    EXPECT_GT(clip.clips, 20);
    EXPECT_GT(clip.aborts, 3);
    EXPECT_GT(abort.aborts, 20);
    EXPECT_GT(skip.skips, 50);
    EXPECT_EQ(skip.clips, 0);
  }
}
