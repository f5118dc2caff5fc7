// NCCL collectives through LibTorch c10d's ProcessGroupNCCL, one GPU per rank. Built with
// LOCKSTEP_CUDA only: the one file that includes ProcessGroupNCCL (and nccl.h through it, the
// nccl.h of the nvidia-nccl wheel that torch links). CPU tensors (the per-step stats vectors)
// are staged through the GPU, since NCCL moves device memory only.
#include <c10/cuda/CUDAGuard.h>
#include <fmt/core.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <chrono>

#include "comm_store.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

using std::chrono::milliseconds;

milliseconds to_ms(double seconds) { return milliseconds(static_cast<int64_t>(seconds * 1e3)); }

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

class NcclComm final : public Comm {
 public:
  NcclComm(c10::intrusive_ptr<c10d::Store> store, int rank, int size, const CommOptions& o)
      : rank_(rank), size_(size), device_(c10::kCUDA, static_cast<c10::DeviceIndex>(o.cuda_device)),
        timeout_(to_ms(o.train_timeout_seconds)) {
    c10::cuda::set_device(device_.index());
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout_;
    try {
      pg_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
    } catch (const std::exception& e) {
      throw Error(ExitCode::kFailure, fmt::format("nccl setup failed for rank {} of {} on {}: {}",
                                                  rank, size, device_.str(), first_line(e.what())));
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }

  std::unique_ptr<CommWork> all_reduce_sum_async(at::Tensor& t) override {
    at::Tensor d = on_device(t);
    std::vector<at::Tensor> v = {d};
    return finish(pg_->allreduce(v), "all_reduce", {{d, t}});
  }
  void broadcast(at::Tensor& t, int root) override {
    at::Tensor d = on_device(t);
    std::vector<at::Tensor> v = {d};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    finish(pg_->broadcast(v, o), "broadcast", {{d, t}})->wait();
  }
  std::unique_ptr<CommWork> all_gather_async(const at::Tensor& in,
                                             const std::vector<at::Tensor>& out) override {
    std::vector<at::Tensor> dout;
    std::vector<std::pair<at::Tensor, at::Tensor>> copies;
    for (const auto& t : out) {
      dout.push_back(on_device(t));
      copies.emplace_back(dout.back(), t);
    }
    std::vector<std::vector<at::Tensor>> o = {dout};
    std::vector<at::Tensor> i = {on_device(in)};
    return finish(pg_->allgather(o, i), "all_gather", std::move(copies));
  }
  std::unique_ptr<CommWork> reduce_scatter_sum_async(const std::vector<at::Tensor>& in,
                                                     at::Tensor& out) override {
    std::vector<at::Tensor> blocks;
    for (const auto& t : in) blocks.push_back(on_device(t));
    at::Tensor dout = on_device(out);
    std::vector<at::Tensor> o = {dout};
    std::vector<std::vector<at::Tensor>> i = {blocks};
    return finish(pg_->reduce_scatter(o, i), "reduce_scatter", {{dout, out}});
  }
  void barrier() override {
    c10d::BarrierOptions o;
    o.device_ids = {device_.index()};
    wait(pg_->barrier(o), "barrier");
  }

 private:
  at::Tensor on_device(const at::Tensor& t) const { return t.is_cuda() ? t : t.to(device_); }
  // The work's completion: wait (under the timeout), then copy staged results to host originals.
  std::unique_ptr<CommWork> finish(c10::intrusive_ptr<c10d::Work> work, const char* op,
                                   std::vector<std::pair<at::Tensor, at::Tensor>> copies) {
    return std::make_unique<CommWork>([this, work, op, copies] {
      wait(work, op);
      for (const auto& [staged, t] : copies)
        if (!t.is_cuda()) t.copy_(staged);
    });
  }
  // A wait with a timeout blocks the host until the collective is done: a lost rank gives an
  // error naming the operation (and NCCL's watchdog tears the communicator down).
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* op) {
    try {
      work->wait(timeout_);
    } catch (const std::exception& e) {
      throw Error(ExitCode::kFailure,
                  fmt::format("nccl {} failed on rank {} of {} (timeout {} s; did a rank die or "
                              "stall?): {}",
                              op, rank_, size_, timeout_.count() / 1000.0, first_line(e.what())));
    }
  }

  int rank_, size_;
  c10::Device device_;
  milliseconds timeout_;
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg_;
};

}  // namespace

bool nccl_available() { return true; }

std::unique_ptr<Comm> make_nccl_comm(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                     const CommOptions& options) {
  return std::make_unique<NcclComm>(std::move(store), rank, size, options);
}

}  // namespace lockstep
