// Where a run's step is decided (skip.device_decision): on the device, or on the host, and why.
// Apart from the device decision itself because it asks the communication layer which backend
// the run resolves to (the PyTorch package builds device_decision.cpp without it).
#include <fmt/format.h>

#include "comm/comm.h"
#include "decide/device_decision.h"

namespace lockstep {

UpdatePath update_path(const Config& c, c10::Device device, int local_ranks) {
  UpdatePath u;
  u.on_gpu = device.is_cuda();
  // Gloo and MPI read the table on the host anyway (three blocking copies a step on a GPU);
  // the for-loop AdamW reads found_inf with .item() per parameter.
  const Backend backend = resolve_backend(c.parallelism.backend, device, local_ranks);
  if (backend == Backend::kGloo || backend == Backend::kMpi)
    u.host_exchange =
        fmt::format("parallelism.backend = \"{}\" exchanges on the host", name_of(backend));
  if (c.optimizer.implementation == AdamWImpl::kForLoop)
    u.host_read = "optimizer.implementation = \"for-loop\" reads each skip on the host";
  return u;
}

bool decides_on_device(const Config& c, c10::Device device, int local_ranks) {
  return device_decides(c, update_path(c, device, local_ranks));
}

std::string decides_on_host_because(const Config& c, c10::Device device, int local_ranks) {
  return host_decides_because(update_path(c, device, local_ranks));
}

}  // namespace lockstep
