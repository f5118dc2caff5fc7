#include "fsutil.h"

#include <fcntl.h>
#include <ftw.h>
#include <fmt/core.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
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

int open_regular(const std::string& path) {
  // O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail("read", path, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw InputError(fmt::format("cannot read '{}': not a regular file (a directory, FIFO or "
                                 "device); pass a file",
                                 path));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

std::string read_file(const std::string& path) {
  const int fd = open_regular(path);
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      fail("read", path, err);  // e.g. EIO: never take a half-read file for the whole
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

bool exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

// POSIX nftw, depth first, links not followed. Not std::filesystem::remove_all: the torch wheels
// carry their own copy of the std::filesystem functions (exported by libtorch_cpu.so, so every
// call binds to it), and torch 2.11's remove_all called a null pointer on the lent H200 machine
// as soon as the folder had contents.
void remove_all(const std::string& path) {
  ::nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, struct FTW*) {
        ::remove(p);  // errors ignored, as the contract says; the walk goes on
        return 0;
      },
      16, FTW_DEPTH | FTW_PHYS);
}

}  // namespace lockstep::fs
