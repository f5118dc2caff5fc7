// The Comm over a LibTorch c10d process group, one class for every c10d backend (Gloo, NCCL):
// every host wait has the collective timeout and names the operation (NCCL's waits are the
// stream's: see C10dGroup::host_waits). Tensors on another device than the library's are moved
// by the staging decorator (staged.cpp) around it.
#include <fmt/core.h>

#include <chrono>
#include <thread>
#include <utility>
#include <vector>

#include "comm/c10d.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

class C10dComm final : public Comm {
 public:
  explicit C10dComm(C10dGroup g) : g_(std::move(g)) {}

  int rank() const override { return g_.rank; }
  int size() const override { return g_.size; }
  std::string backend() const override { return g_.name; }

  std::unique_ptr<CommWork> all_reduce_sum_async(at::Tensor& t) override {
    std::vector<at::Tensor> v = {t};
    return finish(g_.pg->allreduce(v), "all_reduce");
  }
  std::unique_ptr<CommWork> all_reduce_max_async(at::Tensor& t) override {
    std::vector<at::Tensor> v = {t};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    return finish(g_.pg->allreduce(v, o), "all_reduce_max");
  }
  void broadcast(at::Tensor& t, int root) override {
    std::vector<at::Tensor> v = {t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    finish(g_.pg->broadcast(v, o), "broadcast")->wait();
  }
  // Gloo reads and writes the blocks where they lie (its list forms take one pointer per
  // block); NCCL's one-buffer forms want them back to back, so blocks apart are staged.
  std::unique_ptr<CommWork> all_gather_async(const at::Tensor& in, at::Tensor& out) override {
    check_blocks(out, in, "all_gather");
    at::Tensor i = in;
    if (g_.name == "gloo" && !out.is_contiguous()) {
      std::vector<std::vector<at::Tensor>> outs = {blocks_of(out)};
      std::vector<at::Tensor> ins = {i};
      return finish(g_.pg->allgather(outs, ins), "all_gather");
    }
    at::Tensor o = out.is_contiguous() ? out.view({-1}) : at::empty({out.numel()}, out.options());
    auto work = finish(g_.pg->_allgather_base(o, i), "all_gather");
    if (o.data_ptr() == out.data_ptr()) return work;
    return std::make_unique<CommWork>(
        [w = std::shared_ptr<CommWork>(std::move(work)), o, out]() mutable {
          w->wait();
          out.copy_(o.view(out.sizes()));
        });
  }
  std::unique_ptr<CommWork> reduce_scatter_sum_async(const at::Tensor& in,
                                                     at::Tensor& out) override {
    check_blocks(in, out, "reduce_scatter");
    at::Tensor o = out;
    if (g_.name == "gloo") {  // also where they lie together: its one-buffer form was slower
      std::vector<at::Tensor> outs = {o};
      std::vector<std::vector<at::Tensor>> ins = {blocks_of(in)};
      return finish(g_.pg->reduce_scatter(outs, ins), "reduce_scatter");
    }
    at::Tensor i = in.contiguous().view({-1});
    c10d::ReduceScatterOptions opts;
    return finish(g_.pg->_reduce_scatter_base(o, i, opts), "reduce_scatter");
  }
  void barrier() override { wait(g_.pg->barrier(g_.barrier), "barrier"); }
  c10::Device device() const override { return g_.stage; }
  double timeout() const override { return g_.timeout.count() / 1000.0; }
  void set_timeout(double seconds) override {
    g_.timeout = to_ms(seconds);  // what every wait here allows
    try {
      g_.pg->setTimeout(g_.timeout);  // Gloo's own deadline (a backend may not offer one)
    } catch (const std::exception&) {
    }
  }

 private:
  // `whole` holds size() blocks of `block` (flat, or rows that are contiguous).
  void check_blocks(const at::Tensor& whole, const at::Tensor& block, const char* op) const {
    const bool rows = whole.is_contiguous() || (whole.dim() == 2 && whole.size(0) == g_.size &&
                                                whole.stride(1) == 1);
    if (whole.numel() != block.numel() * g_.size || !rows || !block.is_contiguous())
      throw std::invalid_argument(fmt::format(
          "{} {}: needs {} blocks of the other tensor's {} elements, each contiguous", g_.name,
          op, g_.size, block.numel()));
  }
  std::vector<at::Tensor> blocks_of(const at::Tensor& whole) const {
    return whole.reshape({g_.size, -1}).unbind(0);  // rows are views: a flat buffer or strided
  }
  // The work's completion: a wait under the timeout.
  std::unique_ptr<CommWork> finish(c10::intrusive_ptr<c10d::Work> work, const char* op) {
    return std::make_unique<CommWork>([this, work, op] { wait(work, op); });
  }
  // A wait with a timeout blocks the host until the collective is done: a lost rank gives an
  // error naming the operation instead of a hang. Without host waits (NCCL) the current stream
  // waits and the watchdog bounds a hang.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* op) {
    try {
      if (g_.host_waits)
        work->wait(g_.timeout);
      else
        work->wait();
    } catch (const std::exception& e) {
      if (stalled_.empty()) stalled_ = roll_call();
      throw Error(ExitCode::kFailure,
                  fmt::format("{} {} failed on rank {} of {} (timeout {} s): {}; {}", g_.name, op,
                              g_.rank, g_.size, g_.timeout.count() / 1000.0, stalled_,
                              first_line(e.what())));
    }
  }

  // After a timeout: this rank says it arrived in the job's store and waits a while for the
  // others to say so too (each of them times out on the same collective, or on the one before);
  // the ones that never do are the stalled or dead ones. Once per process.
  std::string roll_call() {
    if (!g_.store) return "did a rank die or stall?";
    const double window = roll_call_seconds(g_.timeout.count() / 1000.0);
    const auto key = [](int r) { return fmt::format("lockstep/arrived/{}", r); };
    std::vector<int> missing;
    try {
      g_.store->setTimeout(to_ms(window));
      g_.store->set(key(g_.rank), std::vector<uint8_t>{'1'});
      const auto deadline = std::chrono::steady_clock::now() + to_ms(window);
      for (;;) {
        missing.clear();
        for (int r = 0; r < g_.size; ++r)
          if (r != g_.rank && !g_.store->check({key(r)})) missing.push_back(r);
        if (missing.empty() || std::chrono::steady_clock::now() > deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    } catch (const std::exception&) {
      return "no roll call: the rendezvous store did not answer either (rank 0 or the "
             "launcher's agent serves it: stopped or dead, or the job is ending)";
    }
    return stalled_ranks_words(missing, window);
  }

  C10dGroup g_;
  std::string stalled_;  // the roll call's words, once taken
};

}  // namespace

C10dGroup group_of(c10::intrusive_ptr<c10d::Backend> pg, c10::Device stage,
                   std::chrono::milliseconds timeout, int rank, int size) {
  if (!stage.is_cuda()) return {std::move(pg), "gloo", stage, {}, timeout, rank, size};
  c10d::BarrierOptions barrier;
  barrier.device_ids = {stage.index()};
  // No timed waits: they would busy-poll the host. The watchdog (the group's own timeout) ends a
  // collective that hangs: TORCH_NCCL_ASYNC_ERROR_HANDLING (default 3 in the torch versions we
  // build against) aborts the communicator and the process, so the launcher fails the job.
  return {std::move(pg), "nccl", stage, barrier, timeout, rank, size, /*host_waits=*/false};
}

std::unique_ptr<Comm> comm_over(C10dGroup group) {
  return staged(std::make_unique<C10dComm>(std::move(group)));
}

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1e3));
}

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

}  // namespace lockstep
