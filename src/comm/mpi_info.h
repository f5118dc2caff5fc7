#pragma once

#include <string>

namespace lockstep {

// The MPI library's own version line (MPI_Get_library_version; callable before MPI_Init).
std::string mpi_library_version();

}  // namespace lockstep
