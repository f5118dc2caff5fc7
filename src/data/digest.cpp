#include "data/digest.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "fsutil.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

constexpr size_t kChunk = 8u << 20;  // bytes read at a time

std::string cache_folder() {
  if (const char* set = std::getenv("LOCKSTEP_DIGEST_CACHE"); set && *set)
    return std::string(set) == "off" ? "" : set;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg)
    return std::string(xdg) + "/lockstep/digests";
  if (const char* home = std::getenv("HOME"); home && *home)
    return std::string(home) + "/.cache/lockstep/digests";
  return "";
}

// What identifies this version of the file: a rewrite changes its mtime and ctime (a copy with
// preserved times, its inode).
nlohmann::json identity(const std::string& path, const struct stat& st) {
  return {{"path", path},
          {"bytes", static_cast<int64_t>(st.st_size)},
          {"mtime_ns", static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec},
          {"ctime_ns", static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec},
          {"inode", static_cast<uint64_t>(st.st_ino)},
          {"device", static_cast<uint64_t>(st.st_dev)}};
}

std::string crc_of(int fd, const std::string& path) {
  std::vector<char> buffer(kChunk);
  uint32_t crc = 0;
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      throw InputError(fmt::format("cannot read '{}': {}; check the file and the disk", path,
                                   std::strerror(errno)));
    if (n == 0) break;
    crc = crc32_of(buffer.data(), static_cast<size_t>(n), crc);
  }
  return fmt::format("{:08x}", crc);
}

}  // namespace

ContentDigest content_digest(const std::string& path) {
  const std::string absolute = std::filesystem::absolute(path).lexically_normal().string();
  const int fd = fs::open_regular(path);
  struct stat st {};
  ::fstat(fd, &st);
  const nlohmann::json id = identity(absolute, st);
  const std::string folder = cache_folder();
  const std::string entry =
      folder.empty() ? "" : fmt::format("{}/{:08x}.json", folder,
                                        crc32_of(absolute.data(), absolute.size(), 0));
  ContentDigest d;
  d.bytes = static_cast<int64_t>(st.st_size);
  try {
    if (!entry.empty() && std::filesystem::exists(entry)) {
      const nlohmann::json saved = nlohmann::json::parse(fs::read_file(entry));
      if (saved.at("file") == id) {
        ::close(fd);
        d.crc32 = saved.at("crc32").get<std::string>();
        d.cached = true;
        return d;
      }
    }
  } catch (const std::exception&) {  // a damaged entry is read again
  }
  try {
    d.crc32 = crc_of(fd, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  if (entry.empty()) return d;
  try {  // each writer its own temporary file: ranks sharing the cache never mix their bytes
    fs::make_dirs(folder);
    const std::string tmp = fmt::format("{}.{}.tmp", entry, ::getpid());
    fs::write_file_synced(tmp, nlohmann::json{{"file", id}, {"crc32", d.crc32}}.dump());
    if (::rename(tmp.c_str(), entry.c_str()) != 0) std::filesystem::remove(tmp);
  } catch (const std::exception&) {  // no cache: the next start reads the file again
  }
  return d;
}

}  // namespace lockstep
