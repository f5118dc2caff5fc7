#pragma once

#include <string>

namespace lockstep {

// Lines like "lockstep 0.1.0", "LibTorch 2.13.0", "CUDA ...", "NCCL ...", "MPI ...".
std::string version_report();

}  // namespace lockstep
