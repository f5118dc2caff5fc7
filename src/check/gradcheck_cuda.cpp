// CUDA glue of the gradient check: the plan's lifetime, its device and that device's current
// stream. Built only with LOCKSTEP_CUDA; the kernels themselves live in kernels/gradcheck.cu.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <fmt/core.h>

#include <stdexcept>

#include "check/gradcheck_cuda.h"

namespace lockstep {

namespace {
// A CUDA error as one line naming where it was raised and on which device.
void check(int err, const char* what, int device, int line) {
  if (err != 0)
    throw std::runtime_error(fmt::format("gradient check ({}:{}, cuda:{}): {} failed: {}",
                                         __FILE__, line, device, what,
                                         cudaGetErrorString(static_cast<cudaError_t>(err))));
}
}  // namespace

std::unique_ptr<GradCheck::Cuda> GradCheck::Cuda::create(
    const std::vector<kernels::Segment>& segments, int num_tensors, int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  auto c = std::make_unique<Cuda>();
  check(kernels::cuda_plan_create(segments.data(), static_cast<int>(segments.size()),
                                  num_tensors, &c->plan),
        "building the CUDA plan", device, __LINE__);
  return c;
}

void GradCheck::Cuda::run(double* out, int first, int last) {
  const auto device = static_cast<c10::DeviceIndex>(kernels::cuda_plan_device(plan));
  const c10::cuda::CUDAGuard guard(device);
  check(kernels::cuda_check(plan, out, c10::cuda::getCurrentCUDAStream(device).stream(), first,
                            last),
        "the check kernel launch", device, __LINE__);
}

void GradCheck::Cuda::run_early(int first, int last) {
  const auto device = static_cast<c10::DeviceIndex>(kernels::cuda_plan_device(plan));
  const c10::cuda::CUDAGuard guard(device);
  check(kernels::cuda_check_chunks(plan, first, last,
                                   c10::cuda::getCurrentCUDAStream(device).stream()),
        "the early check kernel launch", device, __LINE__);
}

int GradCheck::Cuda::chunks() const { return kernels::cuda_plan_chunks(plan); }

void GradCheck::Cuda::sum(double* out) {
  const auto device = static_cast<c10::DeviceIndex>(kernels::cuda_plan_device(plan));
  const c10::cuda::CUDAGuard guard(device);
  check(kernels::cuda_sum(plan, out, c10::cuda::getCurrentCUDAStream(device).stream()),
        "the sum kernel launch", device, __LINE__);
}

GradCheck::Cuda::~Cuda() { kernels::cuda_plan_destroy(plan); }

}  // namespace lockstep
