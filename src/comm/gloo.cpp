// Gloo process groups through LibTorch c10d, and the rendezvous stores every c10d backend uses
// (the collectives themselves: c10d.cpp). The only file that includes Gloo or the c10d stores.
// The torch wheel ships no gloo headers; Debian's libgloo-dev provides them (launch/setup.sh).
// GPU tensors come through host memory (the staging decorator, staged.cpp): Gloo is the CPU
// backend; it serves ranks that share one GPU, which NCCL refuses.
#include <fmt/core.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "comm/c10d.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

// A Gloo process group: loopback for one node; otherwise the interface that GLOO_SOCKET_IFNAME
// names, or the one this host's name resolves to.
std::unique_ptr<Comm> make_gloo(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                const RankInfo& ranks, const CommOptions& o) {
  auto opts = c10d::ProcessGroupGloo::Options::create();
  opts->timeout = to_ms(o.init_timeout_seconds);
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  else if (ranks.local_world_size == ranks.world_size)
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  else
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
  try {
    pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  } catch (const std::exception& e) {
    throw Error(ExitCode::kFailure, fmt::format("gloo rendezvous failed for rank {} of {}: {}",
                                                rank, size, first_line(e.what())));
  }
  const auto timeout = to_ms(o.train_timeout_seconds);
  pg->setTimeout(timeout);
  C10dGroup g = group_of(pg, c10::Device(c10::kCPU), timeout, rank, size);
  g.store = store;
  return comm_over(std::move(g));
}

// The store path serves the c10d backends; MPI has its own rendezvous (mpirun).
void check_backend(const CommOptions& o) {
  if (o.backend != Backend::kGloo && o.backend != Backend::kNccl)
    throw std::invalid_argument(fmt::format("a c10d store serves gloo and nccl, not '{}'",
                                            name_of(o.backend)));
  if (o.backend == Backend::kNccl && !nccl_available())
    throw ConfigError("invalid value for 'parallelism.backend': \"nccl\" but this build has no "
                      "CUDA (LOCKSTEP_CUDA=OFF); build with a CUDA torch (launch/build_cuda.sh) "
                      "or use \"gloo\"");
}

std::unique_ptr<Comm> make_backend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                   const RankInfo& ranks, const CommOptions& o) {
  if (o.backend == Backend::kNccl) return make_nccl_comm(std::move(store), rank, size, o);
  return make_gloo(std::move(store), rank, size, ranks, o);
}

}  // namespace

#if !LOCKSTEP_WITH_NCCL
bool nccl_available() { return false; }

std::unique_ptr<Comm> make_nccl_comm(c10::intrusive_ptr<c10d::Store>, int, int,
                                     const CommOptions& o) {
  check_backend(o);
  return nullptr;
}
#endif

namespace {

// The store server's listening socket, bound to `host` only (TCPStore alone would listen on
// every interface).
int listen_socket(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0)
    throw ConfigError(fmt::format("cannot resolve '{}' for the rendezvous store: {}; check "
                                  "MASTER_ADDR or comm.store_listen_address",
                                  host, ::gai_strerror(rc)));
  int err = 0;
  for (addrinfo* a = found; a; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
      ::freeaddrinfo(found);
      return fd;
    }
    err = errno;
    ::close(fd);
  }
  ::freeaddrinfo(found);
  throw ConfigError(fmt::format("the rendezvous store cannot listen on {}:{}: {}; choose another "
                                "MASTER_PORT (--master-port) or comm.store_listen_address",
                                host, port, std::strerror(err)));
}

}  // namespace

std::unique_ptr<Comm> make_c10d_comm(const RankInfo& ranks, const CommOptions& options) {
  check_backend(options);
  // The whole rendezvous (the store, then the process group) within init_timeout_seconds.
  const auto start = std::chrono::steady_clock::now();
  CommOptions o = options;
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(ranks.master_port);
  so.isServer = ranks.rank == 0 && !ranks.use_agent_store;
  so.numWorkers = ranks.use_agent_store ? std::nullopt : std::optional<size_t>(ranks.world_size);
  so.waitWorkers = false;
  so.timeout = to_ms(o.init_timeout_seconds);
  if (so.isServer)
    so.masterListenFd = listen_socket(
        o.store_listen_address == "auto" ? ranks.master_addr : o.store_listen_address,
        ranks.master_port);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(ranks.master_addr, so);
  } catch (const std::exception& e) {
    throw Error(ExitCode::kFailure,
                fmt::format("cannot reach the rendezvous store at {}:{} from rank {}: {}",
                            ranks.master_addr, ranks.master_port, ranks.rank, first_line(e.what())));
  }
  if (!ranks.store_prefix().empty())
    store = c10::make_intrusive<c10d::PrefixStore>(ranks.store_prefix(), store);
  const double spent =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  o.init_timeout_seconds = std::max(1.0, o.init_timeout_seconds - spent);
  return make_backend(store, ranks.rank, ranks.world_size, ranks, o);
}

std::unique_ptr<Comm> make_comm_file_store(const std::string& path, int rank, int size,
                                           const CommOptions& o) {
  check_backend(o);
  auto store = c10::make_intrusive<c10d::FileStore>(path, size);
  RankInfo one_node;
  one_node.rank = rank;
  one_node.world_size = one_node.local_world_size = size;
  return make_backend(store, rank, size, one_node, o);
}

}  // namespace lockstep
