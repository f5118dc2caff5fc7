// The decision core (src/decide/core/) as small kernels. The table form: one thread decides over
// the [W, 9] table and the windows, then one thread per rank advances its own windows; the
// per-tensor rules follow on the same stream. The record form: three one-thread kernels around
// the collectives (decide/device_record.h). Compiled with --fmad=false (CMakeLists.txt): the
// host's bits.
#include <cuda_runtime.h>

#include "kernels/decide_step.h"

namespace lockstep::kernels {
using namespace core;
namespace {

__global__ void decide_kernel(const double* table, int world, DecideState* state,
                              DecideConfig config, DecideResult* out, float* found_inf,
                              float* grad_scale) {
  if (threadIdx.x == 0) decide_global(table, world, *state, config, *out, found_inf, grad_scale);
  __syncthreads();  // the outcome, in global memory, is seen by the whole block
  for (int r = static_cast<int>(threadIdx.x); r < world; r += static_cast<int>(blockDim.x))
    record_rank(*state, config, table, *out, BeforeSync{}, r);
}

// The per-tensor policies after the step's decision (the same stream: `result` is written).
__global__ void decide_tensors_kernel(const double* table, int world, const double* sums,
                                      int tensors, const DecideState* state, DecideConfig config,
                                      TensorRule rule, const DecideResult* result, int64_t* taken,
                                      double* gamma, float* factors, float* resets) {
  __shared__ int spike;
  const DecideResult& r = *result;
  if (threadIdx.x == 0)
    spike = rule.reset != 0 && global_spike(table, world, *state, config, r) ? 1 : 0;
  __syncthreads();
  const int64_t seen = *taken;
  for (int i = static_cast<int>(threadIdx.x); i < tensors; i += static_cast<int>(blockDim.x)) {
    const TensorAction a = decide_tensor(rule, seen, gamma[i],
                                         tensor_norm(sums, world, tensors, i, r.loss_scale), r,
                                         spike != 0);
    factors[i] = static_cast<float>(a.factor);
    resets[i] = a.reset ? 1.0f : 0.0f;
  }
  __syncthreads();  // every thread read `seen` before it moves
  if (threadIdx.x == 0 && tensor_step_taken(r)) *taken = seen + 1;
}

__global__ void record_contribute_kernel(const double* row, const DecideState* state,
                                         DecideConfig config, StepRecord* out) {
  record_contribute(row, *state, config, *out);
}

__global__ void record_below_kernel(const double* row, const StepRecord* all, int64_t* below) {
  *below = record_below(row, *all);
}

__global__ void decide_record_kernel(const StepRecord* all, int world, const int64_t* below,
                                     const double* row, DecideState* state, DecideConfig config,
                                     DecideResult* out, float* found_inf, float* grad_scale) {
  decide_record_step(*all, world, *below, row, *state, config, *out, found_inf, grad_scale);
}

}  // namespace

int launch_record_contribute(const double* row, const DecideState* state,
                             const DecideConfig& config, StepRecord* out, void* stream) {
  record_contribute_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(row, state, config,
                                                                           out);
  return static_cast<int>(cudaGetLastError());
}

int launch_record_below(const double* row, const StepRecord* all, int64_t* below, void* stream) {
  record_below_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(row, all, below);
  return static_cast<int>(cudaGetLastError());
}

int launch_decide_record(const StepRecord* all, int world, const int64_t* below, const double* row,
                         DecideState* state, const DecideConfig& config, DecideResult* out,
                         float* found_inf, float* grad_scale, void* stream) {
  decide_record_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(
      all, world, below, row, state, config, out, found_inf, grad_scale);
  return static_cast<int>(cudaGetLastError());
}

int launch_decide_tensors(const double* table, int world, const double* sums, int tensors,
                          DecideState* state, const DecideConfig& config, const TensorRule& rule,
                          const DecideResult* result, int64_t* taken, double* gamma,
                          float* factors, float* resets, void* stream) {
  decide_tensors_kernel<<<1, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      table, world, sums, tensors, state, config, rule, result, taken, gamma, factors, resets);
  return static_cast<int>(cudaGetLastError());
}

int launch_decide_step(const double* table, int world, DecideState* state,
                       const DecideConfig& config, DecideResult* out, float* found_inf,
                       float* grad_scale, void* stream) {
  const int threads = world < 32 ? 32 : world < 256 ? (world + 31) / 32 * 32 : 256;
  decide_kernel<<<1, threads, 0, static_cast<cudaStream_t>(stream)>>>(table, world, state, config,
                                                                        out, found_inf,
                                                                        grad_scale);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace lockstep::kernels
