#include "fsutil.h"

#include <fcntl.h>
#include <fmt/core.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "lockstep/error.h"

namespace lockstep::fs {
namespace {

[[noreturn]] void fail(const char* what, const std::string& path, int err) {
  throw InputError(fmt::format("cannot {} '{}': {}", what, path, std::strerror(err)));
}

}  // namespace

void make_dirs(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec)
    throw InputError(fmt::format("cannot create directory '{}': {}; choose a writable "
                                 "job.dump_folder",
                                 path, ec.message()));
}

void write_file_synced(const std::string& path, std::string_view data) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("create", path, errno);
  const char* p = data.data();
  size_t left = data.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      fail("write", path, err);  // e.g. ENOSPC: the caller's previous file is untouched
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    fail("fsync", path, err);
  }
  if (::close(fd) != 0) fail("close", path, errno);
}

void sync_dir(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("open directory", path, errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) fail("fsync directory", path, err);
}

void write_file_atomic(const std::string& path, std::string_view data) {
  const std::string tmp = path + ".tmp";
  write_file_synced(tmp, data);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename into", path, errno);
  auto parent = std::filesystem::path(path).parent_path().string();
  sync_dir(parent.empty() ? "." : parent);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("read", path, errno ? errno : ENOENT);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

void remove_all(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

}  // namespace lockstep::fs
