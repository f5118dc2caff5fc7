// Small helpers shared by the torch-facing components.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace lockstep {

// A tensor with the stable name used in checkpoints and diagnostics.
struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};

// "cpu" | "cuda" | "auto" -> a device (cuda: the GPU of this local rank, made current);
// throws ConfigError if cuda is asked for but missing.
c10::Device resolve_device(const std::string& name, int local_rank = 0);

}  // namespace lockstep
