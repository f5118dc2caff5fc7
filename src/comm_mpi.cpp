// MPI collectives (OpenMPI) behind the Comm interface. With mpi_info.cpp, the only file that
// includes mpi.h. Collectives are the non-blocking MPI calls completed under a deadline, so a
// lost rank gives an error naming the operation instead of a hang (MPI itself has no timeout).
#include <fmt/core.h>
#include <mpi.h>

#include <chrono>
#include <thread>

#include "comm.h"
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
    MPI_Comm_free(&comm_);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_mpi_ && !finalized) MPI_Finalize();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  void all_reduce_sum(at::Tensor& t) override {
    check(t, "all_reduce");
    MPI_Request req;
    MPI_Iallreduce(MPI_IN_PLACE, t.data_ptr(), static_cast<int>(t.numel()), mpi_type(t, "all_reduce"),
                   MPI_SUM, comm_, &req);
    wait(req, "all_reduce");
  }
  void broadcast(at::Tensor& t, int root) override {
    check(t, "broadcast");
    MPI_Request req;
    MPI_Ibcast(t.data_ptr(), static_cast<int>(t.numel()), mpi_type(t, "broadcast"), root, comm_,
               &req);
    wait(req, "broadcast");
  }
  void all_gather(const at::Tensor& in, at::Tensor& out) override {
    check(in, "all_gather");
    check(out, "all_gather");
    if (out.numel() != in.numel() * size_)
      throw std::invalid_argument("mpi all_gather: out must hold size() x in elements");
    MPI_Request req;
    const MPI_Datatype ty = mpi_type(in, "all_gather");
    MPI_Iallgather(in.data_ptr(), static_cast<int>(in.numel()), ty, out.data_ptr(),
                   static_cast<int>(in.numel()), ty, comm_, &req);
    wait(req, "all_gather");
  }
  void barrier() override {
    MPI_Request req;
    MPI_Ibarrier(comm_, &req);
    wait(req, "barrier");
  }

 private:
  static void check(const at::Tensor& t, const char* op) {
    if (!t.device().is_cpu() || !t.is_contiguous() || t.numel() > INT32_MAX)
      throw std::invalid_argument(fmt::format(
          "mpi {}: expects a contiguous CPU tensor of at most 2^31-1 elements", op));
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
      if ((i & 63) == 0 && Clock::now() > deadline)
        throw Error(ExitCode::kFailure,
                    fmt::format("mpi {} did not finish on rank {} of {} within "
                                "comm.train_timeout_seconds = {} s; did a rank die or stall?",
                                op, rank_, size_, timeout_));
    }
  }

  double timeout_;
  bool owns_mpi_ = false;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm(const RankInfo& ranks, const CommOptions& options) {
  return std::make_unique<MpiComm>(ranks, options);
}

}  // namespace lockstep
