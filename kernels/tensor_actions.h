// The per-tensor actions of a step decided on the device (AdaGC's clip, SPAM's moment reset:
// src/decide/core/, "per tensor"), applied to the optimizer's tensors with no host read. Each
// target (a gradient or an AdamW moment, fp32) belongs to tensor `index` of the decision's list
// and reads that tensor's value: kScaleBy multiplies its elements by it (1: untouched), kZeroIf
// zeroes them when it is 1 (0: untouched). A target its value leaves alone costs the read of
// that one value, so a clean step costs a launch. Bit for bit what the host form does (ATen's
// mul_ by the factor as fp32, zero_()).
#pragma once

#include <cstdint>

namespace lockstep::kernels {

struct TensorTarget {
  float* data;
  int64_t numel;
  int32_t index;  // its tensor's place in the decision's list
};

enum TensorOp : int32_t { kScaleBy = 0, kZeroIf = 1 };

// On the CPU, at once.
void apply_tensor_values_cpu(const TensorTarget* targets, int n, const float* values, TensorOp op);

// On `stream` (a cudaStream_t); `targets` in host memory (passed in the launches' arguments),
// `values` in device memory. Returns a cudaError_t as int (0 = launched). CUDA builds only.
int launch_apply_tensor_values(const TensorTarget* targets, int n, const float* values,
                               TensorOp op, void* stream);

}  // namespace lockstep::kernels
