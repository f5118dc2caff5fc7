// The one place that picks a backend for a job and connects to it (training and `lockstep
// bench comm` alike).
#include <fmt/core.h>

#include "comm/comm.h"
#include "lockstep/error.h"

namespace lockstep {

#if LOCKSTEP_WITH_MPI
bool mpi_available() { return true; }
#else
bool mpi_available() { return false; }
#endif

Backend resolve_backend(Backend requested, c10::Device device) {
  if (requested == Backend::kAuto)
    return device.is_cuda() && nccl_available() ? Backend::kNccl : Backend::kGloo;
  if (requested == Backend::kNccl && !device.is_cuda())
    throw ConfigError("invalid value for 'parallelism.backend': \"nccl\" moves GPU memory but "
                      "training.device is the CPU; use \"gloo\" or \"mpi\" on CPUs");
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

std::unique_ptr<Comm> connect(const RankInfo& ranks, Backend requested, c10::Device device,
                              const CommConfig& config) {
  CommOptions o{resolve_backend(requested, device), device.is_cuda() ? device.index() : 0,
                config.init_timeout_seconds, config.train_timeout_seconds,
                config.store_listen_address};
#if LOCKSTEP_WITH_MPI
  if (o.backend == Backend::kMpi) return make_mpi_comm(ranks, o);
#endif
  return make_c10d_comm(ranks, o);
}

}  // namespace lockstep
