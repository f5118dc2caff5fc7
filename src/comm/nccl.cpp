// NCCL process groups through LibTorch c10d's ProcessGroupNCCL, one GPU per rank (the
// collectives themselves: c10d.cpp; staged.cpp brings CPU tensors such as the per-step stats
// to the GPU, since NCCL moves device memory only). Built with LOCKSTEP_CUDA only: the one
// file that includes ProcessGroupNCCL (and nccl.h through it, the nccl.h of the nvidia-nccl
// wheel that torch links).
#include <c10/cuda/CUDAGuard.h>
#include <fmt/core.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "comm/c10d.h"
#include "lockstep/error.h"

namespace lockstep {

bool nccl_available() { return true; }

std::unique_ptr<Comm> make_nccl_comm(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                     const CommOptions& o) {
  const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(o.cuda_device));
  c10::cuda::set_device(device.index());
  const auto timeout = to_ms(o.train_timeout_seconds);
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg;
  try {
    pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
  } catch (const std::exception& e) {
    throw Error(ExitCode::kFailure, fmt::format("nccl setup failed for rank {} of {} on {}: {}",
                                                rank, size, device.str(), first_line(e.what())));
  }
  return comm_over(group_of(pg, device, timeout, rank, size));  // opts->timeout: the watchdog's
}

}  // namespace lockstep
