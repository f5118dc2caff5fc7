// MPI collectives (OpenMPI) behind the Comm interface. With mpi_info.cpp, the only file that
// includes mpi.h. Collectives are the non-blocking MPI calls completed under a deadline, so a
// lost rank gives an error naming the operation instead of a hang (MPI itself has no timeout).
#include <fmt/core.h>
#include <ATen/ops/empty.h>
#include <mpi.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

MPI_Datatype mpi_type(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kLong: return MPI_INT64_T;
    case at::kInt: return MPI_INT32_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kBFloat16:  // moved bit for bit; sums are staged through fp32 (summable)
    case at::kHalf: return MPI_UINT16_T;
    default:
      throw std::invalid_argument(fmt::format("mpi {}: dtype {} is not supported (float, double, "
                                              "int64, int32, uint8)",
                                              op, c10::toString(t.scalar_type())));
  }
}

class MpiComm final : public Comm {
 public:
  MpiComm(const RankInfo& ranks, const CommOptions& o)
      : timeout_(o.train_timeout_seconds) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
      owns_mpi_ = true;
    }
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    if (rank_ != ranks.rank || size_ != ranks.world_size)
      throw ConfigError(fmt::format(
          "parallelism.backend = \"mpi\": MPI says rank {} of {} but the environment says rank {} "
          "of {}; launch with mpirun -np N (not torchrun or srun without PMIx) or use backend "
          "\"gloo\"",
          rank_, size_, ranks.rank, ranks.world_size));
  }
  ~MpiComm() override {
    // After a collective failed, a peer is dead or stalled: MPI_Comm_free and MPI_Finalize would
    // wait for it forever. Leave MPI as it is; the process exits with its error and mpirun, seeing
    // a rank end without finalizing, stops the others.
    if (failed_) return;
    MPI_Comm_free(&comm_);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_mpi_ && !finalized) MPI_Finalize();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  std::unique_ptr<CommWork> all_reduce_sum_async(at::Tensor& t) override {
    return all_reduce(t, MPI_SUM, "all_reduce");
  }
  std::unique_ptr<CommWork> all_reduce_max_async(at::Tensor& t) override {
    return all_reduce(t, MPI_MAX, "all_reduce_max");
  }
  void broadcast(at::Tensor& t, int root) override {
    at::Tensor h = host(t, "broadcast");
    MPI_Request req;
    MPI_Ibcast(h.data_ptr(), static_cast<int>(h.numel()), mpi_type(h, "broadcast"), root, comm_,
               &req);
    wait(req, "broadcast");
    back(h, t);
  }
  // MPI wants the blocks back to back: blocks that lie apart are staged through one buffer.
  std::unique_ptr<CommWork> all_gather_async(const at::Tensor& in, at::Tensor& out) override {
    const at::Tensor hin = host(in, "all_gather");
    if (out.numel() != hin.numel() * size_)
      throw std::invalid_argument("mpi all_gather: out holds one block of in per rank");
    const at::Tensor hout =
        host(out.is_contiguous() ? out : at::empty(out.sizes(), out.options()), "all_gather");
    MPI_Request req;
    const MPI_Datatype ty = mpi_type(hin, "all_gather");
    MPI_Iallgather(hin.data_ptr(), static_cast<int>(hin.numel()), ty, hout.data_ptr(),
                   static_cast<int>(hin.numel()), ty, comm_, &req);
    return std::make_unique<CommWork>([this, req, hin, hout, out]() mutable {
      wait(req, "all_gather");
      back(hout, out);
    });
  }
  std::unique_ptr<CommWork> reduce_scatter_sum_async(const at::Tensor& in,
                                                     at::Tensor& out) override {
    const int64_t n = out.numel();
    if (in.numel() != n * size_)
      throw std::invalid_argument("mpi reduce_scatter: in holds one block of out per rank");
    at::Tensor hin = summable(host(in.contiguous(), "reduce_scatter"));
    at::Tensor hout = summable(host(out, "reduce_scatter"));
    MPI_Request req;
    MPI_Ireduce_scatter_block(hin.data_ptr(), hout.data_ptr(), static_cast<int>(n),
                              mpi_type(hout, "reduce_scatter"), MPI_SUM, comm_, &req);
    return std::make_unique<CommWork>([this, req, hin, hout, out]() mutable {
      wait(req, "reduce_scatter");
      back(hout, out);
    });
  }
  double timeout() const override { return timeout_; }
  void set_timeout(double seconds) override { timeout_ = seconds; }
  void barrier() override {
    MPI_Request req;
    MPI_Ibarrier(comm_, &req);
    wait(req, "barrier");
  }

 private:
  // The host tensor MPI works on (CUDA-aware MPI is not assumed: the staging decorator brings
  // GPU tensors here).
  static at::Tensor host(const at::Tensor& t, const char* op) {
    if (!t.is_contiguous() || t.numel() > INT32_MAX || !t.is_cpu())
      throw std::invalid_argument(fmt::format(
          "mpi {}: expects a contiguous host tensor of at most 2^31-1 elements", op));
    return t;
  }
  // MPI has no sum of 16-bit floats: a bf16 or fp16 tensor is summed as an fp32 copy (twice the
  // bytes on the wire, one rounding at the end).
  static at::Tensor summable(const at::Tensor& h) {
    const bool half = h.scalar_type() == at::kBFloat16 || h.scalar_type() == at::kHalf;
    return half ? h.to(at::kFloat) : h;
  }
  // In place, with `op` (the sum or the largest), started now.
  std::unique_ptr<CommWork> all_reduce(at::Tensor& t, MPI_Op op, const char* name) {
    at::Tensor h = summable(host(t, name));
    MPI_Request req;
    MPI_Iallreduce(MPI_IN_PLACE, h.data_ptr(), static_cast<int>(h.numel()), mpi_type(h, name),
                   op, comm_, &req);
    return std::make_unique<CommWork>([this, req, h, t, name]() mutable {
      wait(req, name);
      back(h, t);
    });
  }
  // Copies the result into the original when MPI worked on a copy (an fp32 sum of 16-bit floats).
  static void back(const at::Tensor& staged, const at::Tensor& t) {
    if (!staged.is_same(t)) t.copy_(staged);
  }

  // Completes `req` or throws naming `op` once train_timeout_seconds have passed. Spins first
  // (small collectives finish in microseconds), then polls gently so a waiting rank does not
  // take the core from a busy one.
  void wait(MPI_Request& req, const char* op) {
    using Clock = std::chrono::steady_clock;
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_);
    for (int i = 0;; ++i) {
      int done = 0;
      MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (done) return;
      if (i > 2000) std::this_thread::sleep_for(std::chrono::microseconds(50));
      if ((i & 63) == 0 && Clock::now() > deadline) {
        if (!failed_) stalled_ = roll_call();
        failed_ = true;
        throw Error(ExitCode::kFailure,
                    fmt::format("mpi {} did not finish on rank {} of {} within "
                                "comm.train_timeout_seconds = {} s: {}",
                                op, rank_, size_, timeout_, stalled_));
      }
    }
  }

  // After a timeout: this rank sends every other rank one small message ("arrived") and takes
  // theirs for a while (each of them times out on the same collective, or on the one before);
  // the ranks whose message never comes stopped answering. Point-to-point on a tag of its own:
  // the collective still pending keeps its own matching. The requests are left in flight: the
  // process exits with its error (see ~MpiComm).
  std::string roll_call() {
    constexpr int kRollCallTag = 7301;
    const double window = roll_call_seconds(timeout_);
    roll_in_.assign(static_cast<size_t>(size_), 0);
    std::vector<MPI_Request> recv(static_cast<size_t>(size_), MPI_REQUEST_NULL);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      MPI_Request send;
      MPI_Isend(&roll_out_, 1, MPI_INT, r, kRollCallTag, comm_, &send);
      MPI_Request_free(&send);
      MPI_Irecv(&roll_in_[static_cast<size_t>(r)], 1, MPI_INT, r, kRollCallTag, comm_,
                &recv[static_cast<size_t>(r)]);
    }
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(window);
    std::vector<int> missing;
    for (;;) {
      missing.clear();
      for (int r = 0; r < size_; ++r) {
        int done = 1;
        if (recv[static_cast<size_t>(r)] != MPI_REQUEST_NULL)
          MPI_Test(&recv[static_cast<size_t>(r)], &done, MPI_STATUS_IGNORE);
        if (!done) missing.push_back(r);
      }
      if (missing.empty() || std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return stalled_ranks_words(missing, window);
  }

  double timeout_;
  bool owns_mpi_ = false;
  bool failed_ = false;  // a collective timed out: never block in MPI again
  std::string stalled_;  // the roll call's words, once taken
  int roll_out_ = 1;
  std::vector<int> roll_in_;  // the others' "arrived" (alive while the receives are in flight)
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm(const RankInfo& ranks, const CommOptions& options) {
  return staged(std::make_unique<MpiComm>(ranks, options));
}

}  // namespace lockstep
