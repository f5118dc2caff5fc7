// Tensors where the backend's library wants them, for every backend alike: a tensor on another
// device than the backend's (a GPU tensor for Gloo or MPI, a host tensor for NCCL) is copied
// there before the collective, and the result is copied back when the work is waited for. A GPU
// tensor comes down to the host with a blocking copy: a host library reads it at once (an
// asynchronous copy into pinned memory may not have landed: on the lent H200 two ranks over
// Gloo named a NaN gradient a step late that way). The backends themselves see only tensors on
// their own device.
#include <ATen/ops/empty_like.h>

#include <utility>

#include "comm/comm.h"

namespace lockstep {
namespace {

class StagedComm final : public Comm {
 public:
  explicit StagedComm(std::unique_ptr<Comm> inner)
      : inner_(std::move(inner)), home_(inner_->device()) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  c10::Device device() const override { return home_; }
  double timeout() const override { return inner_->timeout(); }
  void set_timeout(double seconds) override { inner_->set_timeout(seconds); }
  void barrier() override { inner_->barrier(); }

  std::unique_ptr<CommWork> all_reduce_sum_async(at::Tensor& t) override {
    at::Tensor s = staged(t);
    return then(inner_->all_reduce_sum_async(s), {{s, t}});
  }
  std::unique_ptr<CommWork> all_reduce_max_async(at::Tensor& t) override {
    at::Tensor s = staged(t);
    return then(inner_->all_reduce_max_async(s), {{s, t}});
  }
  void broadcast(at::Tensor& t, int root) override {
    at::Tensor s = staged(t);
    inner_->broadcast(s, root);
    back({{s, t}});
  }
  // In place (`in` is this rank's block of `out`, or `out` its block of `in`): the block is
  // copied, so no library reads what it writes (MPI forbids it, NCCL allows it in one layout).
  std::unique_ptr<CommWork> all_gather_async(const at::Tensor& in, at::Tensor& out) override {
    at::Tensor s = staged(out);
    const at::Tensor i = overlap(in, s) ? in.clone() : staged(in);
    return then(inner_->all_gather_async(i, s), {{s, out}});
  }
  std::unique_ptr<CommWork> reduce_scatter_sum_async(const at::Tensor& in,
                                                     at::Tensor& out) override {
    at::Tensor s = staged(out);
    if (overlap(in, s)) s = at::empty_like(s);
    return then(inner_->reduce_scatter_sum_async(staged(in), s), {{s, out}});
  }

 private:
  using Copies = std::vector<std::pair<at::Tensor, at::Tensor>>;  // staged, original

  bool at_home(const at::Tensor& t) const { return t.device().type() == home_.type(); }
  // Whether two tensors share any byte of memory.
  static bool overlap(const at::Tensor& a, const at::Tensor& b) {
    if (!a.is_alias_of(b) || a.numel() == 0 || b.numel() == 0) return false;
    const auto span = [](const at::Tensor& t) {
      int64_t last = 0;
      for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
      const auto* lo = static_cast<const char*>(t.const_data_ptr());
      return std::pair(lo, lo + (last + 1) * t.element_size());
    };
    const auto [a_lo, a_hi] = span(a);
    const auto [b_lo, b_hi] = span(b);
    return a_lo < b_hi && b_lo < a_hi;
  }
  at::Tensor staged(const at::Tensor& t) const { return at_home(t) ? t : t.to(home_); }
  // The results into the originals that were staged.
  void back(const Copies& copies) const {
    for (const auto& [s, t] : copies)
      if (!s.is_same(t)) t.copy_(s);
  }
  std::unique_ptr<CommWork> then(std::unique_ptr<CommWork> work, Copies copies) {
    return std::make_unique<CommWork>(
        [this, w = std::shared_ptr<CommWork>(std::move(work)), copies = std::move(copies)] {
          w->wait();
          back(copies);
        });
  }

  std::unique_ptr<Comm> inner_;
  c10::Device home_;
};

}  // namespace

std::unique_ptr<Comm> staged(std::unique_ptr<Comm> inner) {
  return std::make_unique<StagedComm>(std::move(inner));
}

}  // namespace lockstep
