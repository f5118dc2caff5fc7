// The decision core (src/decide/core/) as kernels on the step's stream: the verdict, found_inf
// and grad_scale are written on the device without a host round trip. CUDA builds only.
#pragma once

#include <cstdint>

#include "decide/core/step.h"
#include "decide/core/tensors.h"

namespace lockstep::kernels {

// core::decide_step: decide_global on one thread, then record_rank on one thread per rank. Every
// pointer is device memory, `state`'s rings included. Returns a cudaError_t as int (0: launched).
int launch_decide_step(const double* table, int world, core::DecideState* state,
                       const core::DecideConfig& config, core::DecideResult* out,
                       float* found_inf, float* grad_scale, void* stream);

// core::decide_tensors after launch_decide_step wrote `result`: one thread per tensor; `taken`
// one int64. Returns a cudaError_t as int.
int launch_decide_tensors(const double* table, int world, const double* sums, int tensors,
                          core::DecideState* state, const core::DecideConfig& config,
                          const core::TensorRule& rule, const core::DecideResult* result,
                          int64_t* taken, double* gamma, float* factors, float* resets,
                          void* stream);

}  // namespace lockstep::kernels
