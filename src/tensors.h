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

}  // namespace lockstep
