// The decision core (src/decide/core/) as kernels on the step's stream: the verdict, found_inf
// and grad_scale are written on the device without a host round trip. CUDA builds only.
#pragma once

#include <cstdint>

#include "decide/core/record.h"
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

// The record form (decide/core/record.h), one thread each: this rank's part of the record; its
// part of the cross-rank count once `all` holds every rank's; the step and this rank's own
// windows once `below` holds the count. Returns a cudaError_t as int.
int launch_record_contribute(const double* row, const core::DecideState* state,
                             const core::DecideConfig& config, core::StepRecord* out,
                             void* stream);
int launch_record_below(const double* row, const core::StepRecord* all, int64_t* below,
                        void* stream);
int launch_decide_record(const core::StepRecord* all, int world, const int64_t* below,
                         const double* row, core::DecideState* state,
                         const core::DecideConfig& config, core::DecideResult* out,
                         float* found_inf, float* grad_scale, void* stream);

}  // namespace lockstep::kernels
