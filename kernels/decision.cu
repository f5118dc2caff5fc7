// The step decision's shared core (kernels/decision.h) as one small kernel: a few hundred fp64
// operations on one thread over a [W, 9] table and the windows (each rank's own read only on an
// anomalous step), then each rank's windows advanced by a thread of its own; launched on the
// step's stream, so the verdict, found_inf and grad_scale are written on the device without a
// host round trip.
// Compiled with --fmad=false (CMakeLists.txt): no FMA contraction, so the device computes the
// host's bits.
#include <cuda_runtime.h>

#include "kernels/decision.h"

namespace lockstep::kernels {
namespace {

__global__ void decide_kernel(const double* table, int world, DecideState* state,
                              DecideConfig config, DecideResult* out, float* found_inf,
                              float* grad_scale) {
  if (threadIdx.x == 0) decide_global(table, world, *state, config, *out, found_inf, grad_scale);
  __syncthreads();  // the outcome, in global memory, is seen by the whole block
  for (int r = static_cast<int>(threadIdx.x); r < world; r += static_cast<int>(blockDim.x))
    record_rank(*state, config, table, *out, Settled{}, r);
}

}  // namespace

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
