#include "lockstep/version.h"

#include <dlfcn.h>
#include <elf.h>
#include <fmt/core.h>
#include <link.h>
#include <torch/version.h>

#include "lockstep/build_info.h"

#ifdef LOCKSTEP_WITH_CUDA
#include "kernels/device_info.h"
#endif
#ifdef LOCKSTEP_WITH_MPI
#include "comm/mpi_info.h"
#endif

namespace lockstep {
namespace {

struct BuildIdSearch {
  const void* start = nullptr;  // where the object holding build_id() is mapped (dladdr)
  std::string id;
};

// The hex of an NT_GNU_BUILD_ID note among a loaded object's PT_NOTE segments, or "".
std::string note_build_id(const struct dl_phdr_info* info) {
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_NOTE) continue;
    const char* p = reinterpret_cast<const char*>(info->dlpi_addr + ph.p_vaddr);
    const char* end = p + ph.p_memsz;
    while (p + sizeof(ElfW(Nhdr)) <= end) {
      const auto* note = reinterpret_cast<const ElfW(Nhdr)*>(p);
      const char* name = p + sizeof(ElfW(Nhdr));
      const char* desc = name + ((note->n_namesz + 3) & ~3u);
      if (note->n_type == NT_GNU_BUILD_ID && note->n_namesz == 4 &&
          std::string_view(name, 3) == "GNU") {
        std::string id;
        for (uint32_t b = 0; b < note->n_descsz; ++b)
          id += fmt::format("{:02x}", static_cast<unsigned char>(desc[b]));
        return id;
      }
      p = desc + ((note->n_descsz + 3) & ~3u);
    }
  }
  return "";
}

// dl_iterate_phdr's callback: the object whose first mapped byte is search->start.
int match_object(struct dl_phdr_info* info, size_t, void* data) {
  auto* search = static_cast<BuildIdSearch*>(data);
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type == PT_LOAD && ph.p_offset == 0 &&
        reinterpret_cast<const void*>(info->dlpi_addr + ph.p_vaddr) == search->start) {
      search->id = note_build_id(info);
      return 1;
    }
  }
  return 0;
}

// "jemalloc 5.3.0-..." when jemalloc is the process's malloc (CMakeLists.txt links it), else
// the C library's.
std::string allocator() {
  using Mallctl = int (*)(const char*, void*, size_t*, void*, size_t);
  const auto mallctl = reinterpret_cast<Mallctl>(::dlsym(RTLD_DEFAULT, "mallctl"));
  const char* version = nullptr;
  size_t size = sizeof version;
  if (mallctl != nullptr && mallctl("version", &version, &size, nullptr, 0) == 0 && version)
    return fmt::format("jemalloc {}", version);
  return "the C library's";
}

}  // namespace

std::string build_id() {
  static const std::string id = [] {
    Dl_info where{};
    BuildIdSearch search;
    if (::dladdr(reinterpret_cast<void*>(&build_id), &where) != 0) {
      search.start = where.dli_fbase;
      ::dl_iterate_phdr(match_object, &search);
    }
    return search.id.empty() ? std::string("unknown") : search.id;
  }();
  return id;
}

std::string version_report() {
  std::string out = fmt::format("lockstep {} (build id {})\nLibTorch {}\nmalloc: {}\n",
                                LOCKSTEP_VERSION, build_id(), TORCH_VERSION, allocator());
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
