// The one place that picks a backend for a job and connects to it (training and `lockstep
// bench comm` alike).
#include <fmt/core.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "comm/comm.h"
#include "lockstep/error.h"

namespace lockstep {

#if LOCKSTEP_WITH_MPI
bool mpi_available() { return true; }
#else
bool mpi_available() { return false; }
#endif

Backend resolve_backend(Backend requested, c10::Device device, int local_ranks, int gpus) {
  const bool gpu_each = device.is_cuda() && local_ranks <= gpus;
  if (requested == Backend::kAuto)
    return gpu_each && nccl_available() ? Backend::kNccl : Backend::kGloo;
  if (requested == Backend::kNccl && !device.is_cuda())
    throw ConfigError("invalid value for 'parallelism.backend': \"nccl\" moves GPU memory but "
                      "training.device is the CPU; use \"gloo\" or \"mpi\" on CPUs");
  if (requested == Backend::kNccl && !gpu_each)
    throw ConfigError(fmt::format(
        "invalid value for 'parallelism.backend': \"nccl\" but this node runs {} ranks on {} "
        "GPU(s) and NCCL needs a GPU per rank; start at most {} ranks per node "
        "(--nproc-per-node) or use \"gloo\"",
        local_ranks, gpus, gpus));
  if (requested == Backend::kNccl && !nccl_available())
    throw ConfigError("invalid value for 'parallelism.backend': \"nccl\" but this build has no "
                      "CUDA (LOCKSTEP_CUDA=OFF); build with a CUDA torch (launch/build_cuda.sh) "
                      "or use \"gloo\"");
  if (requested == Backend::kMpi && !mpi_available())
    throw ConfigError(
        "invalid value for 'parallelism.backend': \"mpi\" but this build has no MPI "
        "(LOCKSTEP_MPI=OFF); install libopenmpi-dev and rebuild, or use \"gloo\"");
  return requested;
}

Backend resolve_backend(Backend requested, c10::Device device, int local_ranks) {
  const int gpus = device.is_cuda() && c10::impl::hasDeviceGuardImpl(c10::kCUDA)
                       ? c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount()
                       : 0;
  return resolve_backend(requested, device, local_ranks, gpus);
}

std::unique_ptr<Comm> connect(const RankInfo& ranks, Backend requested, c10::Device device,
                              const CommConfig& config) {
  CommOptions o{resolve_backend(requested, device, ranks.local_world_size),
                device.is_cuda() ? device.index() : 0,
                config.init_timeout_seconds, config.train_timeout_seconds,
                config.store_listen_address};
#if LOCKSTEP_WITH_MPI
  if (o.backend == Backend::kMpi) return make_mpi_comm(ranks, o);
#endif
  return make_c10d_comm(ranks, o);
}

}  // namespace lockstep
