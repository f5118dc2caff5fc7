#pragma once

#include <string>

namespace lockstep {

// Lines like "lockstep 0.1.0", "LibTorch 2.13.0", "CUDA ...", "NCCL ...", "MPI ...".
std::string version_report();

// The GNU build id of the binary holding lockstep's code ("fa53cc34..."): another build, even of
// the same version, has another one. "unknown" when the linker wrote none.
std::string build_id();

}  // namespace lockstep
