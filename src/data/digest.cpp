#include "data/digest.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
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

// This user's key for the cache's entries: 32 random bytes in `folder`/key (mode 0600), made
// once (the first writer's wins: each writes its own file and links it into place). Empty when
// it can be neither read nor made: then no entry is trusted, and none is written.
std::string cache_key(const std::string& folder) {
  const std::string path = folder + "/key";
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      if (std::filesystem::exists(path)) {
        std::string key = fs::read_file(path);
        return key.size() == 32 ? key : "";
      }
      fs::make_dirs(folder);
      unsigned char bytes[32];
      if (RAND_bytes(bytes, sizeof bytes) != 1) return "";
      const std::string tmp = fmt::format("{}.{}.tmp", path, ::getpid());
      const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (fd < 0) return "";
      const bool wrote = ::write(fd, bytes, sizeof bytes) == static_cast<ssize_t>(sizeof bytes);
      ::close(fd);
      if (wrote) (void)::link(tmp.c_str(), path.c_str());  // fails if another writer won
      std::filesystem::remove(tmp);
    } catch (const std::exception&) {
      return "";
    }
  }
  return "";
}

// The entry's keyed digest (HMAC-SHA256 under this user's key): an entry edited by hand, or
// copied from another user's cache, does not carry it, and its file is read again.
std::string entry_mac(const std::string& key, const nlohmann::json& file, const std::string& crc) {
  const std::string text = nlohmann::json{{"file", file}, {"crc32", crc}}.dump();
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (!HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
            reinterpret_cast<const unsigned char*>(text.data()), text.size(), md, &n))
    return "";
  std::string hex;
  for (unsigned int i = 0; i < n; ++i) hex += fmt::format("{:02x}", md[i]);
  return hex;
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
  const std::string key = folder.empty() ? "" : cache_key(folder);
  ContentDigest d;
  d.bytes = static_cast<int64_t>(st.st_size);
  try {
    if (!key.empty() && std::filesystem::exists(entry)) {
      const nlohmann::json saved = nlohmann::json::parse(fs::read_file(entry));
      if (saved.at("file") == id) {
        const std::string crc = saved.at("crc32").get<std::string>();
        const std::string mac = entry_mac(key, id, crc);
        if (!mac.empty() && saved.value("mac", "") == mac) {
          ::close(fd);
          d.crc32 = crc;
          d.cached = true;
          return d;
        }
        d.distrusted = true;  // this file's entry without its key's digest: read again
      }
    }
  } catch (const std::exception&) {  // a damaged entry is read again
    d.distrusted = true;
  }
  try {
    d.crc32 = crc_of(fd, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  const std::string mac = key.empty() ? "" : entry_mac(key, id, d.crc32);
  if (mac.empty()) return d;
  try {  // each writer its own temporary file: ranks sharing the cache never mix their bytes
    fs::make_dirs(folder);
    const std::string tmp = fmt::format("{}.{}.tmp", entry, ::getpid());
    fs::write_file_synced(tmp,
                          nlohmann::json{{"file", id}, {"crc32", d.crc32}, {"mac", mac}}.dump());
    if (::rename(tmp.c_str(), entry.c_str()) != 0) std::filesystem::remove(tmp);
  } catch (const std::exception&) {  // no cache: the next start reads the file again
  }
  return d;
}

}  // namespace lockstep
