// The per-tensor actions of a step decided on the device (kernels/tensor_actions.h) over
// tensors: each of `targets` (contiguous fp32, on the values' device) reads values[index[i]];
// kScaleBy multiplies it (1: untouched), kZeroIf zeroes it when it is 1. Runs at once on the
// CPU, on the current stream of a GPU; no host read. lockstep's AdamW (apply_on_device) and the
// PyTorch guard (python/csrc/ext.cpp) both apply theirs through it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "kernels/tensor_actions.h"

namespace lockstep {

void apply_tensor_values(const std::vector<at::Tensor>& targets,
                         const std::vector<int32_t>& index, const at::Tensor& values,
                         kernels::TensorOp op);

}  // namespace lockstep
