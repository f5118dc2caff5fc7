// The only translation unit that includes mpi.h.
#include "comm/mpi_info.h"

#include <mpi.h>

namespace lockstep {

std::string mpi_library_version() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(buf, &len);
  std::string s(buf, static_cast<size_t>(len));
  auto nl = s.find_first_of("\n,");  // first line / clause only
  return nl == std::string::npos ? s : s.substr(0, nl);
}

}  // namespace lockstep
