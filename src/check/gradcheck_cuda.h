// GradCheck's CUDA state (defined in gradcheck_cuda.cpp, built only with LOCKSTEP_CUDA).
#pragma once

#include <memory>
#include <vector>

#include "check/gradcheck.h"

namespace lockstep {

struct GradCheck::Cuda {
  // Builds the plan on CUDA device `device` (the gradients').
  static std::unique_ptr<Cuda> create(const std::vector<kernels::Segment>& segments,
                                      int num_tensors, int device);
  void run(double* out);
  void sum(double* out);
  ~Cuda();
  kernels::CudaPlan* plan = nullptr;
};

}  // namespace lockstep
