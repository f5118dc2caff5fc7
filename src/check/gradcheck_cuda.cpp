// CUDA glue of the gradient check: the plan's lifetime and the current stream. Built only with
// LOCKSTEP_CUDA; the kernels themselves live in kernels/gradcheck.cu.
#include <c10/cuda/CUDAStream.h>
#include <fmt/core.h>

#include <stdexcept>

#include "check/gradcheck_cuda.h"

namespace lockstep {

namespace {
void check(int err, const char* what) {
  if (err != 0)
    throw std::runtime_error(fmt::format("gradient check: {} failed: {}", what,
                                         cudaGetErrorString(static_cast<cudaError_t>(err))));
}
}  // namespace

std::unique_ptr<GradCheck::Cuda> GradCheck::Cuda::create(
    const std::vector<kernels::Segment>& segments, int num_tensors) {
  auto c = std::make_unique<Cuda>();
  check(kernels::cuda_plan_create(segments.data(), static_cast<int>(segments.size()),
                                  num_tensors, &c->plan),
        "building the CUDA plan");
  return c;
}

void GradCheck::Cuda::run(double* out) {
  check(kernels::cuda_check(plan, out, c10::cuda::getCurrentCUDAStream().stream()),
        "the check kernel launch");
}

void GradCheck::Cuda::sum(double* out) {
  check(kernels::cuda_sum(plan, out, c10::cuda::getCurrentCUDAStream().stream()),
        "the sum kernel launch");
}

GradCheck::Cuda::~Cuda() { kernels::cuda_plan_destroy(plan); }

}  // namespace lockstep
