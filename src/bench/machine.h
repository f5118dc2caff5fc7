// What every benchmark prints first: the machine it ran on.
#pragma once

#include <string>

namespace lockstep {

// "MODEL, N hardware threads, SIMD ISA" (CPU), or the GPU's name, driver and runtime (`cuda`).
std::string describe_machine(bool cuda);

}  // namespace lockstep
