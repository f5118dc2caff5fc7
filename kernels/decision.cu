// The step decision's shared core (kernels/decision.h) as a one-thread kernel: a few hundred
// fp64 operations over a [W, 8] table and two windows, launched on the step's stream, so the
// verdict, found_inf and grad_scale are written on the device without a host round trip.
// Compiled with --fmad=false (CMakeLists.txt): no FMA contraction, so the device computes the
// host's bits.
#include <cuda_runtime.h>

#include "kernels/decision.h"

namespace lockstep::kernels {
namespace {

__global__ void decide_kernel(const double* table, int world, DecideState* state,
                              DecideConfig config, DecideResult* out, float* found_inf,
                              float* grad_scale) {
  decide_step(table, world, *state, config, *out, found_inf, grad_scale);
}

}  // namespace

int launch_decide_step(const double* table, int world, DecideState* state,
                       const DecideConfig& config, DecideResult* out, float* found_inf,
                       float* grad_scale, void* stream) {
  decide_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(table, world, state, config, out,
                                                                  found_inf, grad_scale);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace lockstep::kernels
