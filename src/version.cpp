#include "lockstep/version.h"

#include <fmt/core.h>
#include <torch/version.h>

#include "lockstep/build_info.h"

#ifdef LOCKSTEP_WITH_CUDA
#include "kernels/device_info.h"
#endif
#ifdef LOCKSTEP_WITH_MPI
#include "comm/mpi_info.h"
#endif

namespace lockstep {

std::string version_report() {
  std::string out = fmt::format("lockstep {}\nLibTorch {}\n", LOCKSTEP_VERSION, TORCH_VERSION);
#ifdef LOCKSTEP_WITH_CUDA
  const auto d = kernels::query_device_info();
  out += fmt::format("CUDA runtime {}.{} (compiled for {}.{}), driver {}, {} device(s)\n",
                     d.runtime_version / 1000, (d.runtime_version % 1000) / 10,
                     d.compiled_runtime_version / 1000, (d.compiled_runtime_version % 1000) / 10,
                     d.driver_version > 0 ? fmt::format("{}.{}", d.driver_version / 1000,
                                                        (d.driver_version % 1000) / 10)
                                          : std::string("none"),
                     d.device_count);
  out += fmt::format("NCCL {}.{}.{}\n", d.nccl_version / 10000, (d.nccl_version / 100) % 100,
                     d.nccl_version % 100);
#else
  out += "CUDA not built in (CPU-only LibTorch or no nvcc at build time)\nNCCL not built in\n";
#endif
#ifdef LOCKSTEP_WITH_MPI
  out += fmt::format("MPI {}\n", mpi_library_version());
#else
  out += "MPI not built in\n";
#endif
  return out;
}

}  // namespace lockstep
