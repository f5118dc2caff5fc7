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
  // Checks chunks [first, last) and reduces every chunk's result into `out`.
  void run(double* out, int first, int last);
  // Checks chunks [first, last) now; the next run() reduces them.
  void run_early(int first, int last);
  int chunks() const;
  void sum(double* out);
  ~Cuda();
  kernels::CudaPlan* plan = nullptr;
};

}  // namespace lockstep
