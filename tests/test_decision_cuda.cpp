// The decision's shared core as the device kernels (kernels/decide_step.cu) against the same
// code on the host: every number, the outcome, found_inf, grad_scale, and the windows, guards
// and loss scale each step advances, bit for bit; an abort stays sticky on the device; the
// record form's three kernels (each rank's part, its part of the count, the step and its own
// windows) likewise; the per-tensor policies' kernel (AdaGC's factors, SPAM's resets, the
// thresholds) after it, and the kernel that applies them, bit for bit against their host forms.
// Labelled `gpu`. LOCKSTEP_TEST_STEPS shortens the runs (launch/gpu_check.sh's sanitizers: the
// bits are still compared, the counts of each path are not).
#include <ATen/Context.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <random>
#include <cstring>
#include <string>
#include <vector>

#include "decide/core/record.h"
#include "decide/core/step.h"
#include "decide/core/tensors.h"
#include "decide/verdict.h"
#include "detector_util.h"
#include "kernels/decide_step.h"
#include "kernels/tensor_actions.h"

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
bool same(const core::DecideResult& a, const core::DecideResult& b) {
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
  int skips = 0, clips = 0, aborts = 0, tensor_clips = 0, resets = 0;
};

// The per-tensor policies' state on the host and its twin on the device: 300 tensors (more
// than the kernel's 256 threads), AdaGC and the reset on.
struct Tensors {
  static constexpr int kTensors = 300;
  core::TensorRule rule{1, 1, 1.05, 0.98, 5};
  int64_t taken = 0;
  std::vector<double> gamma = std::vector<double>(kTensors, 0.0);
  double *sums = nullptr, *dev_gamma = nullptr;
  int64_t* dev_taken = nullptr;
  float* dev_flags = nullptr;  // factors, then resets

  explicit Tensors(int world) {
    sums = device_doubles(static_cast<size_t>(world) * kTensors);
    dev_gamma = device_doubles(kTensors);
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, sizeof(int64_t)), cudaSuccess);
    dev_taken = static_cast<int64_t*>(p);
    EXPECT_EQ(cudaMalloc(&p, 2 * kTensors * sizeof(float)), cudaSuccess);
    dev_flags = static_cast<float*>(p);
    restart();
  }
  ~Tensors() {
    for (void* q : {static_cast<void*>(sums), static_cast<void*>(dev_gamma),
                    static_cast<void*>(dev_taken), static_cast<void*>(dev_flags)})
      cudaFree(q);
  }
  void restart() {
    taken = 0;
    gamma.assign(kTensors, 0.0);
    ok(cudaMemcpy(dev_gamma, gamma.data(), kTensors * sizeof(double), cudaMemcpyHostToDevice));
    ok(cudaMemcpy(dev_taken, &taken, sizeof taken, cudaMemcpyHostToDevice));
  }
  // Random partial sums: log-normal, now and then a tensor 100x up, a NaN or an inf.
  std::vector<double> random_sums(std::mt19937_64& rng, int world) const {
    std::lognormal_distribution<double> base(0.0, 0.3);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    std::vector<double> out(static_cast<size_t>(world) * kTensors);
    const bool spike = u(rng) < 0.1;
    for (double& v : out) {
      const double r = u(rng);
      v = base(rng) * (spike && r < 0.3 ? 1e4 : 1.0);
      if (r > 0.9995) v = r > 0.99975 ? std::nan("") : INFINITY;
    }
    return out;
  }
};

// 3000 random steps of `world` ranks under `on_global_spike`, decided by the kernel and by the
// same code on the host: the same result, flags and state (every window, every rank's own
// included), step by step.
Counts expect_kernel_is_host(int world, core::GlobalSpike on_global_spike) {
  core::DecideConfig config{{true, 40, 6, 6}, 8, 1.0, {true, true, 2, 0.5, 7}, 20, 128,
                            2, 0.1, kFractionWindow};
  config.on_global_spike = on_global_spike;
  const int64_t ring_doubles = core::decide_state_doubles(kWindow, kFractionWindow, world);
  double* rings = device_doubles(ring_doubles);
  double* table = device_doubles(world * core::kStatsDoubles);
  void* p = nullptr;
  ok(cudaMalloc(&p, sizeof(core::DecideState)));
  auto* dev = static_cast<core::DecideState*>(p);
  ok(cudaMalloc(&p, sizeof(core::DecideResult)));
  auto* result = static_cast<core::DecideResult*>(p);
  ok(cudaMalloc(&p, 2 * sizeof(float)));
  auto* flags = static_cast<float*>(p);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  std::vector<double> host_rings;
  core::DecideState host{};
  const auto restart = [&] {  // a fresh state on the host and its twin on the device
    host_rings.assign(ring_doubles, 0.0);
    host = core::fresh_decide_state(host_rings.data(), kWindow, kFractionWindow, world, 1024);
    const core::DecideState d =
        core::fresh_decide_state(rings, kWindow, kFractionWindow, world, 1024);
    ok(cudaMemcpy(dev, &d, sizeof d, cudaMemcpyHostToDevice));
    ok(cudaMemcpy(rings, host_rings.data(), host_rings.size() * sizeof(double),
                  cudaMemcpyHostToDevice));
  };
  restart();

  Tensors tensors(world);
  std::mt19937_64 rng(7);
  Counts n;
  for (int step = 1; step <= steps_per_run() && !::testing::Test::HasFailure(); ++step) {
    const auto t = test::random_step(rng, world, host.scale.scale);
    std::vector<double> flat(t.size() * core::kStatsDoubles);
    std::memcpy(flat.data(), t.data(), flat.size() * sizeof(double));
    ok(cudaMemcpy(table, flat.data(), flat.size() * sizeof(double), cudaMemcpyHostToDevice));
    core::DecideResult want{}, got{};
    float want_flags[2], got_flags[2];
    core::decide_step(flat.data(), world, host, config, want, &want_flags[0], &want_flags[1]);
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
    // Then the per-tensor policies from the decided step, on both.
    constexpr int kT = Tensors::kTensors;
    const std::vector<double> sums = tensors.random_sums(rng, world);
    ok(cudaMemcpy(tensors.sums, sums.data(), sums.size() * sizeof(double),
                  cudaMemcpyHostToDevice));
    std::vector<float> want_t(2 * kT), got_t(2 * kT);
    core::decide_tensors(flat.data(), world, sums.data(), kT, host, config, tensors.rule, want,
                         tensors.taken, tensors.gamma.data(), want_t.data(),
                         want_t.data() + kT);
    EXPECT_EQ(kernels::launch_decide_tensors(table, world, tensors.sums, kT, dev, config,
                                             tensors.rule, result, tensors.dev_taken,
                                             tensors.dev_gamma, tensors.dev_flags,
                                             tensors.dev_flags + kT, stream),
              0);
    ok(cudaStreamSynchronize(stream));
    ok(cudaMemcpy(got_t.data(), tensors.dev_flags, got_t.size() * sizeof(float),
                  cudaMemcpyDeviceToHost));
    std::vector<double> got_gamma(kT);
    int64_t got_taken = -1;
    ok(cudaMemcpy(got_gamma.data(), tensors.dev_gamma, kT * sizeof(double),
                  cudaMemcpyDeviceToHost));
    ok(cudaMemcpy(&got_taken, tensors.dev_taken, sizeof got_taken, cudaMemcpyDeviceToHost));
    EXPECT_EQ(std::memcmp(got_t.data(), want_t.data(), got_t.size() * sizeof(float)), 0)
        << "step " << step;
    EXPECT_EQ(std::memcmp(got_gamma.data(), tensors.gamma.data(), kT * sizeof(double)), 0)
        << "step " << step;
    EXPECT_EQ(got_taken, tensors.taken) << "step " << step;
    for (int i = 0; i < kT; ++i) {
      n.tensor_clips += want_t[i] != 1.0f;
      n.resets += want_t[kT + i] != 0.0f;
    }
    n.skips += want.outcome == core::kSkipStep;
    n.clips += want.clipped;
    if (want.outcome == core::kAbortRun) {
      ++n.aborts;
      restart();
      tensors.restart();
    }
  }
  for (void* q : {static_cast<void*>(rings), static_cast<void*>(table), static_cast<void*>(dev),
                  static_cast<void*>(result), static_cast<void*>(flags)})
    cudaFree(q);
  return n;
}

// One rank's own state in the record form on the host and its twin on the device.
struct OwnState {
  std::vector<double> host_rings;
  core::DecideState host{};
  double* rings = nullptr;
  core::DecideState* dev = nullptr;
  OwnState() {
    rings = device_doubles(core::decide_state_doubles(kWindow, kFractionWindow, 1));
    void* p = nullptr;
    ok(cudaMalloc(&p, sizeof(core::DecideState)));
    dev = static_cast<core::DecideState*>(p);
    restart();
  }
  ~OwnState() {
    cudaFree(rings);
    cudaFree(dev);
  }
  OwnState(const OwnState&) = delete;
  OwnState& operator=(const OwnState&) = delete;
  void restart() {
    host_rings.assign(core::decide_state_doubles(kWindow, kFractionWindow, 1), 0.0);
    host = core::fresh_decide_state(host_rings.data(), kWindow, kFractionWindow, 1, 1024);
    const core::DecideState d = core::fresh_decide_state(rings, kWindow, kFractionWindow, 1, 1024);
    ok(cudaMemcpy(dev, &d, sizeof d, cudaMemcpyHostToDevice));
    ok(cudaMemcpy(rings, host_rings.data(), host_rings.size() * sizeof(double),
                  cudaMemcpyHostToDevice));
  }
  std::vector<double> device_rings() const {
    std::vector<double> out(host_rings.size());
    ok(cudaMemcpy(out.data(), rings, out.size() * sizeof(double), cudaMemcpyDeviceToHost));
    return out;
  }
};

template <class T>
T* device_of(const T& v) {
  void* p = nullptr;
  ok(cudaMalloc(&p, sizeof v));
  ok(cudaMemcpy(p, &v, sizeof v, cudaMemcpyHostToDevice));
  return static_cast<T*>(p);
}

template <class T>
T host_of(const T* p) {
  T v;
  ok(cudaMemcpy(&v, p, sizeof v, cudaMemcpyDeviceToHost));
  return v;
}

// The record form's three kernels for `world` ranks (each with its own state), the collectives
// done on the host between them: the same records, counts, results, flags and own windows as
// the host form, bit for bit, step by step. Returns the skips and aborts seen.
Counts expect_record_kernels_are_host(int world) {
  core::DecideConfig config{{true, 40, 6, 6}, 8, 1.0, {true, true, 2, 0.5, 7}, 20, 128,
                            2, 0.1, kFractionWindow};
  config.on_global_spike = core::kSpikeClip;
  std::vector<OwnState> ranks(static_cast<size_t>(world));
  double* row = device_doubles(core::kStatsDoubles);
  core::StepRecord* rec = device_of(core::StepRecord{});
  int64_t* below = device_of(int64_t{0});
  core::DecideResult* result = device_of(core::DecideResult{});
  auto* flags = reinterpret_cast<float*>(device_of(std::array<float, 2>{}));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  std::mt19937_64 rng(11);
  Counts n;
  for (int step = 1; step <= steps_per_run() && !::testing::Test::HasFailure(); ++step) {
    const auto t = test::random_step(rng, world, ranks[0].host.scale.scale);
    const auto row_of = [&](int r) { return rows_of(t) + r * core::kStatsDoubles; };
    core::StepRecord all{};
    for (int r = 0; r < world; ++r) {
      ok(cudaMemcpy(row, row_of(r), core::kStatsDoubles * sizeof(double), cudaMemcpyHostToDevice));
      core::StepRecord want{};
      core::record_contribute(row_of(r), ranks[r].host, config, want);
      EXPECT_EQ(kernels::launch_record_contribute(row, ranks[r].dev, config, rec, stream), 0);
      ok(cudaStreamSynchronize(stream));
      const core::StepRecord got = host_of(rec);
      EXPECT_EQ(std::memcmp(&got, &want, sizeof got), 0) << "step " << step << ", rank " << r;
      if (r == 0) all = want;
      else core::record_combine(all, want);
    }
    ok(cudaMemcpy(rec, &all, sizeof all, cudaMemcpyHostToDevice));  // the all-reduces' work
    int64_t count = 0;
    for (int r = 0; r < world; ++r) {
      ok(cudaMemcpy(row, row_of(r), core::kStatsDoubles * sizeof(double), cudaMemcpyHostToDevice));
      EXPECT_EQ(kernels::launch_record_below(row, rec, below, stream), 0);
      ok(cudaStreamSynchronize(stream));
      EXPECT_EQ(host_of(below), core::record_below(row_of(r), all)) << "step " << step;
      count += core::record_below(row_of(r), all);
    }
    ok(cudaMemcpy(below, &count, sizeof count, cudaMemcpyHostToDevice));
    bool aborted = false;
    for (int r = 0; r < world; ++r) {
      ok(cudaMemcpy(row, row_of(r), core::kStatsDoubles * sizeof(double), cudaMemcpyHostToDevice));
      core::DecideResult want{};
      float want_flags[2];
      core::decide_record_step(all, world, count, row_of(r), ranks[r].host, config, want,
                               &want_flags[0], &want_flags[1]);
      EXPECT_EQ(kernels::launch_decide_record(rec, world, below, row, ranks[r].dev, config,
                                              result, flags, flags + 1, stream),
                0);
      ok(cudaStreamSynchronize(stream));
      EXPECT_TRUE(same(host_of(result), want)) << "step " << step << ", rank " << r;
      float got_flags[2];
      ok(cudaMemcpy(got_flags, flags, sizeof got_flags, cudaMemcpyDeviceToHost));
      EXPECT_EQ(std::memcmp(got_flags, want_flags, sizeof got_flags), 0) << "step " << step;
      EXPECT_EQ(ranks[r].device_rings(), ranks[r].host_rings) << "step " << step << ", rank " << r;
      if (r == 0) {
        n.skips += want.outcome == core::kSkipStep;
        n.clips += want.clipped;
      }
      aborted = aborted || want.outcome == core::kAbortRun;
    }
    if (aborted) {
      ++n.aborts;
      for (OwnState& o : ranks) o.restart();
    }
  }
  for (void* q : {static_cast<void*>(row), static_cast<void*>(rec), static_cast<void*>(below),
                  static_cast<void*>(result), static_cast<void*>(flags)})
    cudaFree(q);
  return n;
}

}  // namespace

// The record form's kernels (decide/device_record.h) on 3 and 40 ranks' records.
TEST(DecisionRecordCuda, TheKernelsComputeTheHostsBits) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  for (int world : {3, 40}) {
    SCOPED_TRACE(std::to_string(world) + " ranks");
    const Counts c = expect_record_kernels_are_host(world);
    if (steps_per_run() < 3000) continue;  // the host form gives 103 / 83 / 129 on 3 ranks
    EXPECT_GT(c.skips, 50);
    EXPECT_GT(c.clips, 20);
    EXPECT_GT(c.aborts, 3);
  }
}

// 4 ranks (one warp) and 40 (two warps record the ranks' windows), each policy.
TEST(DecisionCoreCuda, TheKernelComputesTheHostsBits) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  for (int world : {4, 40}) {
    SCOPED_TRACE(std::to_string(world) + " ranks");
    const Counts clip = expect_kernel_is_host(world, core::kSpikeClip);
    const Counts abort = expect_kernel_is_host(world, core::kSpikeAbort);
    const Counts skip = expect_kernel_is_host(world, core::kSpikeSkip);
    if (steps_per_run() < 3000) continue;  // shortened: every path need not have been taken
    EXPECT_GT(clip.skips, 50);
    EXPECT_GT(clip.clips, 20);
    EXPECT_GT(clip.aborts, 3);
    EXPECT_GT(abort.aborts, 20);
    EXPECT_GT(skip.skips, 50);
    EXPECT_EQ(skip.clips, 0);
    for (const Counts& c : {clip, skip}) {
      EXPECT_GT(c.tensor_clips, 100) << "AdaGC clipped tensors";
      EXPECT_GT(c.resets, 0) << "a global spike reset moments";
    }
  }
}

// The kernel that applies the per-tensor actions against its host form: 70 targets (three
// launches of up to 32), empty to 3 M elements, values 1 (untouched), 0 and others; scaling
// and zeroing, bit for bit.
TEST(TensorActionsCuda, TheKernelActsAsTheHostForm) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const std::vector<int64_t> sizes = {0, 1, 7, 255, 256, 257, 4096, 100003, 3000000};
  std::vector<std::vector<float>> host;
  std::vector<kernels::TensorTarget> on_host, on_device;
  std::vector<float> values;
  for (int t = 0; t < 70; ++t) {
    const int64_t n = sizes[static_cast<size_t>(t) % sizes.size()];
    host.emplace_back(static_cast<size_t>(n));
    for (float& x : host.back()) x = normal(rng);
    void* p = nullptr;
    ok(cudaMalloc(&p, std::max<int64_t>(n, 1) * sizeof(float)));
    ok(cudaMemcpy(p, host.back().data(), n * sizeof(float), cudaMemcpyHostToDevice));
    on_device.push_back({static_cast<float*>(p), n, t % 23});
  }
  for (size_t t = 0; t < host.size(); ++t)
    on_host.push_back({host[t].data(), on_device[t].numel, on_device[t].index});
  for (int i = 0; i < 23; ++i) values.push_back(i % 3 == 0 ? 1.0f : i % 5 == 0 ? 0.0f : 0.37f * i);
  float* dev_values = nullptr;
  ok(cudaMalloc(reinterpret_cast<void**>(&dev_values), values.size() * sizeof(float)));
  ok(cudaMemcpy(dev_values, values.data(), values.size() * sizeof(float),
                cudaMemcpyHostToDevice));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  for (kernels::TensorOp op : {kernels::kScaleBy, kernels::kZeroIf}) {
    kernels::apply_tensor_values_cpu(on_host.data(), static_cast<int>(on_host.size()),
                                     values.data(), op);
    EXPECT_EQ(kernels::launch_apply_tensor_values(on_device.data(),
                                                  static_cast<int>(on_device.size()), dev_values,
                                                  op, stream),
              0);
    ok(cudaStreamSynchronize(stream));
    for (size_t t = 0; t < host.size(); ++t) {
      std::vector<float> got(host[t].size());
      ok(cudaMemcpy(got.data(), on_device[t].data, got.size() * sizeof(float),
                    cudaMemcpyDeviceToHost));
      EXPECT_EQ(std::memcmp(got.data(), host[t].data(), got.size() * sizeof(float)), 0)
          << "target " << t << ", op " << op;
    }
  }
  for (auto& t : on_device) cudaFree(t.data);
  cudaFree(dev_values);
}
