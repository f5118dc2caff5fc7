// Collectives behind one small interface, one implementation per backend (c10d's Backend.hpp
// style). The implementations own the only includes of their libraries: gloo.cpp holds
// LibTorch c10d's ProcessGroupGloo and the stores, nccl.cpp ProcessGroupNCCL (CUDA builds),
// mpi.cpp OpenMPI; c10d.cpp is the Comm over any c10d process group. factory.cpp picks one.
//
// Tensors may live on the CPU or on the GPU with any backend: one decorator (staged.cpp) around
// every backend stages what its library cannot take (NCCL moves device memory only; the CPU
// backends get host copies of GPU tensors).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "lockstep/config.h"
#include "ranks.h"

namespace lockstep {

struct CommOptions {
  Backend backend = Backend::kGloo;    // kGloo | kNccl (make_c10d_comm); kMpi: make_mpi_comm
  int cuda_device = 0;                 // nccl: this rank's GPU
  double init_timeout_seconds = 300;   // rendezvous ([comm] init_timeout_seconds)
  double train_timeout_seconds = 100;  // each collective ([comm] train_timeout_seconds)
  // Where rank 0's TCPStore listens ([comm] store_listen_address): "auto" = the address
  // MASTER_ADDR resolves to, so one node listens on loopback only.
  std::string store_listen_address = "auto";
};

// A collective in flight. wait() completes it: the results are in place (copied back from any
// staging buffer), or it throws as the blocking forms do. Wait for every work you start; the
// tensors must stay alive and untouched until then.
class CommWork {
 public:
  explicit CommWork(std::function<void()> finish) : finish_(std::move(finish)) {}
  void wait() {
    if (!finish_) return;
    auto f = std::move(finish_);
    finish_ = nullptr;
    f();
  }

 private:
  std::function<void()> finish_;
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;
  // Asynchronous collectives: started at once, completed by wait(). Started in the same order
  // on every rank. A collective that does not finish within train_timeout_seconds makes wait()
  // throw an Error that names it (a lost rank never hangs the others).
  virtual std::unique_ptr<CommWork> all_reduce_sum_async(at::Tensor& t) = 0;  // in place
  virtual std::unique_ptr<CommWork> all_reduce_max_async(at::Tensor& t) = 0;  // in place
  // size() blocks in rank order each way: `out` receives rank r's `in` in block r (all-gather);
  // block r of every rank's `in` is summed into rank r's `out` (reduce-scatter). The blocks are
  // one tensor, a flat buffer or a [size(), n] view whose rows are contiguous (the same piece of
  // every rank's block of a larger buffer): no list of per-rank tensors to build.
  virtual std::unique_ptr<CommWork> all_gather_async(const at::Tensor& in, at::Tensor& out) = 0;
  virtual std::unique_ptr<CommWork> reduce_scatter_sum_async(const at::Tensor& in,
                                                             at::Tensor& out) = 0;
  // Blocking collectives.
  virtual void broadcast(at::Tensor& t, int root) = 0;  // in place
  virtual void barrier() = 0;

  // Where this backend wants tensors (others are staged there and back): the GPU for NCCL.
  virtual c10::Device device() const { return c10::Device(c10::kCPU); }

  // The time each collective may take (seconds); a save or load raises it for its own.
  virtual double timeout() const = 0;
  virtual void set_timeout(double seconds) = 0;

  // Blocking forms of the asynchronous ones.
  void all_reduce_sum(at::Tensor& t) { all_reduce_sum_async(t)->wait(); }
  void all_reduce_max(at::Tensor& t) { all_reduce_max_async(t)->wait(); }
  void all_gather(const at::Tensor& in, at::Tensor& out) { all_gather_async(in, out)->wait(); }
  void reduce_scatter_sum(const at::Tensor& in, at::Tensor& out) {
    reduce_scatter_sum_async(in, out)->wait();
  }
};

// Sets a collective timeout for the scope of the object (a null comm: nothing).
class TimeoutScope {
 public:
  TimeoutScope(Comm* comm, double seconds) : comm_(comm) {
    if (!comm_) return;
    before_ = comm_->timeout();
    comm_->set_timeout(seconds);
  }
  ~TimeoutScope() {
    if (comm_) comm_->set_timeout(before_);
  }
  TimeoutScope(const TimeoutScope&) = delete;
  TimeoutScope& operator=(const TimeoutScope&) = delete;

 private:
  Comm* comm_;
  double before_ = 0;
};

// Every rank's `row` (a 1-D tensor, as long on every rank), in rank order, as one [W, n] tensor
// on the host: one all-gather into one tensor on the comm's device (NCCL: no copy up when the
// row is on the GPU already, one read back), not one copy per rank. A null comm is one rank.
at::Tensor all_gather_rows(Comm* comm, const at::Tensor& row);
// The same left where the collective put it (the comm's device; one rank: the row's), read by
// nobody: the device decision decides on it there.
at::Tensor gather_rows(Comm* comm, const at::Tensor& row);

// The same for doubles held on the host (exact for integers below 2^53).
std::vector<std::vector<double>> all_gather_values(Comm* comm, const std::vector<double>& mine);

// "rank 1", "ranks 0, 2-3, 5" (sorted ranks).
std::string rank_list(const std::vector<int>& ranks);

// After a collective timed out, a roll call (each backend's own: the job's store, MPI's
// messages) waits this long for the other ranks to say they arrived: half the timeout, at most
// 15 s (the others time out on the same collective within about a step of this rank).
double roll_call_seconds(double timeout_seconds);
// The error's words for the ranks that did not answer it: "rank 1 did not arrive within 2.5 s
// of this rank's timeout (stopped or dead: that rank stopped answering)", or, when all answered,
// that no rank is lost.
std::string stalled_ranks_words(const std::vector<int>& missing, double window_seconds);

// NCCL is built in (LOCKSTEP_CUDA builds).
bool nccl_available();
// MPI is built in (LOCKSTEP_MPI builds).
bool mpi_available();

// ---- choosing and connecting (factory.cpp): the one place that picks a backend -------------
// The backend a job on `device` uses, `local_ranks` ranks on this node sharing `gpus` GPUs:
// kAuto is NCCL between GPUs (when built in and every rank has a GPU of its own), else Gloo.
// Throws ConfigError naming parallelism.backend when the choice cannot work here (NCCL on the
// CPU, with more ranks than GPUs on a node, or in a build without CUDA; MPI in a build without
// MPI). The short form counts the node's GPUs.
Backend resolve_backend(Backend requested, c10::Device device, int local_ranks, int gpus);
Backend resolve_backend(Backend requested, c10::Device device, int local_ranks = 1);
// This rank's communicator for the job: resolve_backend, then the rendezvous.
std::unique_ptr<Comm> connect(const RankInfo& ranks, Backend requested, c10::Device device,
                              const CommConfig& config);

// ---- the backends -------------------------------------------------------------------------
// Gloo or NCCL (options.backend) with a rendezvous through a c10d TCPStore at
// ranks.master_addr:master_port (rank 0 serves it, or the torchrun agent does), under
// ranks.store_prefix().
std::unique_ptr<Comm> make_c10d_comm(const RankInfo& ranks, const CommOptions& options);

// `inner` behind the staging decorator: a tensor on another device than inner->device() goes
// there for the collective and its result comes back on wait() (every backend is made so).
std::unique_ptr<Comm> staged(std::unique_ptr<Comm> inner);

// MPI collectives over MPI_COMM_WORLD (OpenMPI; builds with LOCKSTEP_MPI only). Initialises MPI
// if needed; throws ConfigError when MPI's rank and size disagree with `ranks`.
std::unique_ptr<Comm> make_mpi_comm(const RankInfo& ranks, const CommOptions& options);

// The same over a c10d FileStore at `path` (tests: N ranks as N threads in one process).
std::unique_ptr<Comm> make_comm_file_store(const std::string& path, int rank, int size,
                                           const CommOptions& options);

}  // namespace lockstep
