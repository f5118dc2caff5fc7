// The decision's shared core as the one-thread device kernel (kernels/decision.cu) against the
// same code on the host: every number, the clean/held screen, found_inf, grad_scale, and the
// windows, loss scale and counters a clean step advances, bit for bit. Labelled `gpu`.
#include <ATen/Context.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "detector_util.h"
#include "kernels/decision.h"

using namespace lockstep;

namespace {

void ok(cudaError_t e) { ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e); }

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Field by field (the struct's padding is not written by the kernel).
bool same(const kernels::ScreenResult& a, const kernels::ScreenResult& b) {
  return same_bits(a.grad_norm, b.grad_norm) && same_bits(a.loss, b.loss) &&
         same_bits(a.grad_norm_z, b.grad_norm_z) && same_bits(a.loss_z, b.loss_z) &&
         same_bits(a.clip, b.clip) && same_bits(a.loss_scale, b.loss_scale) &&
         a.reasons == b.reasons && a.stop == b.stop && a.overflow == b.overflow;
}

template <class T>
T* device_copy(const T* host, size_t n) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  if (host) EXPECT_EQ(cudaMemcpy(p, host, n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return static_cast<T*>(p);
}

}  // namespace

TEST(DecisionCoreCuda, TheKernelComputesTheHostsBits) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  constexpr int64_t kWindow = 32;
  const int world = 4;
  const kernels::ScreenConfig config{{true, 40, 6, 6}, 8, 1.0, {true, true, 2, 0.5, 7}};
  std::vector<double> host_g(kWindow), host_l(kWindow);
  kernels::ScreenState host{};
  host.grad_norms = {host_g.data(), kWindow, 0, 0};
  host.losses = {host_l.data(), kWindow, 0, 0};
  host.scale.scale = 1024;
  kernels::ScreenState dev_init = host;
  dev_init.grad_norms.values = device_copy<double>(nullptr, kWindow);
  dev_init.losses.values = device_copy<double>(nullptr, kWindow);
  kernels::ScreenState* dev = device_copy(&dev_init, 1);
  double* table = device_copy<double>(nullptr, world * kernels::kStatsDoubles);
  kernels::ScreenResult* result = device_copy<kernels::ScreenResult>(nullptr, 1);
  float* flags = device_copy<float>(nullptr, 2);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  std::mt19937_64 rng(7);
  int held = 0;
  for (int step = 1; step <= 600; ++step) {
    const auto t = test::random_step(rng, world, host.scale.scale);
    std::vector<double> flat(t.size() * kernels::kStatsDoubles);
    std::memcpy(flat.data(), t.data(), flat.size() * sizeof(double));
    ok(cudaMemcpy(table, flat.data(), flat.size() * sizeof(double), cudaMemcpyHostToDevice));
    kernels::ScreenResult want{}, got{};
    float want_flags[2], got_flags[2];
    kernels::screen_step(flat.data(), world, host, config, want, &want_flags[0], &want_flags[1]);
    ASSERT_EQ(kernels::launch_screen_step(table, world, dev, config, result, flags, flags + 1,
                                          stream),
              0);
    ok(cudaStreamSynchronize(stream));
    ok(cudaMemcpy(&got, result, sizeof got, cudaMemcpyDeviceToHost));
    ok(cudaMemcpy(got_flags, flags, sizeof got_flags, cudaMemcpyDeviceToHost));
    ASSERT_TRUE(same(got, want)) << "step " << step;
    ASSERT_EQ(std::memcmp(got_flags, want_flags, sizeof got_flags), 0) << "step " << step;
    held += want.reasons != 0;
  }
  kernels::ScreenState end{};
  ok(cudaMemcpy(&end, dev, sizeof end, cudaMemcpyDeviceToHost));
  std::vector<double> g(kWindow), l(kWindow);
  ok(cudaMemcpy(g.data(), dev_init.grad_norms.values, kWindow * sizeof(double),
                cudaMemcpyDeviceToHost));
  ok(cudaMemcpy(l.data(), dev_init.losses.values, kWindow * sizeof(double),
                cudaMemcpyDeviceToHost));
  EXPECT_EQ(g, host_g);
  EXPECT_EQ(l, host_l);
  EXPECT_EQ(end.grad_norms.head, host.grad_norms.head);
  EXPECT_EQ(std::memcmp(&end.scale, &host.scale, sizeof end.scale), 0);
  EXPECT_EQ(end.optimizer_steps, host.optimizer_steps);
  EXPECT_GT(held, 20);
  for (void* p : {static_cast<void*>(dev_init.grad_norms.values),
                  static_cast<void*>(dev_init.losses.values), static_cast<void*>(dev),
                  static_cast<void*>(table), static_cast<void*>(result),
                  static_cast<void*>(flags)})
    cudaFree(p);
}
