// The decision's shared core as the one-thread device kernel (kernels/decision.cu) against the
// same code on the host: every number, the outcome, found_inf, grad_scale, and the windows,
// guards, loss scale and counters each step advances, bit for bit; an abort stays sticky on
// the device. Labelled `gpu`.
#include <ATen/Context.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "detector_util.h"
#include "kernels/decision.h"

using namespace lockstep;

namespace {

void ok(cudaError_t e) { ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e); }

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Field by field (the struct's padding is not written by the kernel).
bool same(const kernels::DecideResult& a, const kernels::DecideResult& b) {
  return same_bits(a.grad_norm, b.grad_norm) && same_bits(a.loss, b.loss) &&
         same_bits(a.grad_norm_z, b.grad_norm_z) && same_bits(a.loss_z, b.loss_z) &&
         same_bits(a.clip, b.clip) && same_bits(a.loss_scale, b.loss_scale) &&
         a.reasons == b.reasons && a.outcome == b.outcome && a.why == b.why &&
         a.overflow == b.overflow && a.stop == b.stop && a.skips_in_window == b.skips_in_window;
}

double* device_doubles(size_t n) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(double)), cudaSuccess);
  return static_cast<double*>(p);
}

constexpr int64_t kWindow = 32, kFractionWindow = 20;

const int64_t kRingDoubles = kernels::decide_state_doubles(kWindow, kFractionWindow);

}  // namespace

TEST(DecisionCoreCuda, TheKernelComputesTheHostsBits) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  const int world = 4;
  const kernels::DecideConfig config{{true, 40, 6, 6}, 8, 1.0, {true, true, 2, 0.5, 7}, 20, 128,
                                     2, 0.1, kFractionWindow};
  double* rings = device_doubles(kRingDoubles);
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
    host_rings.assign(kRingDoubles, 0.0);
    host = kernels::fresh_decide_state(host_rings.data(), kWindow, kFractionWindow, 1024);
    const kernels::DecideState d =
        kernels::fresh_decide_state(rings, kWindow, kFractionWindow, 1024);
    ok(cudaMemcpy(dev, &d, sizeof d, cudaMemcpyHostToDevice));
    ok(cudaMemcpy(rings, host_rings.data(), host_rings.size() * sizeof(double),
                  cudaMemcpyHostToDevice));
  };
  restart();

  std::mt19937_64 rng(7);
  int aborts = 0, skips = 0;
  for (int step = 1; step <= 3000; ++step) {
    const auto t = test::random_step(rng, world, host.scale.scale);
    std::vector<double> flat(t.size() * kernels::kStatsDoubles);
    std::memcpy(flat.data(), t.data(), flat.size() * sizeof(double));
    ok(cudaMemcpy(table, flat.data(), flat.size() * sizeof(double), cudaMemcpyHostToDevice));
    kernels::DecideResult want{}, got{};
    float want_flags[2], got_flags[2];
    kernels::decide_step(flat.data(), world, host, config, want, &want_flags[0], &want_flags[1]);
    ASSERT_EQ(kernels::launch_decide_step(table, world, dev, config, result, flags, flags + 1,
                                          stream),
              0);
    ok(cudaStreamSynchronize(stream));
    ok(cudaMemcpy(&got, result, sizeof got, cudaMemcpyDeviceToHost));
    ok(cudaMemcpy(got_flags, flags, sizeof got_flags, cudaMemcpyDeviceToHost));
    ASSERT_TRUE(same(got, want)) << "step " << step;
    ASSERT_EQ(std::memcmp(got_flags, want_flags, sizeof got_flags), 0) << "step " << step;
    std::vector<double> dev_rings(host_rings.size());
    ok(cudaMemcpy(dev_rings.data(), rings, dev_rings.size() * sizeof(double),
                  cudaMemcpyDeviceToHost));
    ASSERT_EQ(dev_rings, host_rings) << "step " << step;
    skips += want.outcome == kernels::kSkipStep;
    if (want.outcome == kernels::kAbortRun) {
      ++aborts;
      restart();
    }
  }
  EXPECT_GT(skips, 50);
  EXPECT_GT(aborts, 3);
  for (void* q : {static_cast<void*>(rings), static_cast<void*>(table), static_cast<void*>(dev),
                  static_cast<void*>(result), static_cast<void*>(flags)})
    cudaFree(q);
}
