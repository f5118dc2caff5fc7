// Tensors where the backend's library wants them, for every backend alike: a tensor on another
// device than the backend's (a GPU tensor for Gloo or MPI, a host tensor for NCCL) is copied
// there before the collective, and the result is copied back when the work is waited for. A GPU
// tensor comes down to the host with a blocking copy: a host library reads it at once (an
// asynchronous copy into pinned memory may not have landed: on the lent H200 two ranks over
// Gloo named a NaN gradient a step late that way). The backends themselves see only tensors on
// their own device.
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
  void broadcast(at::Tensor& t, int root) override {
    at::Tensor s = staged(t);
    inner_->broadcast(s, root);
    back({{s, t}});
  }
  std::unique_ptr<CommWork> all_gather_async(const at::Tensor& in, at::Tensor& out) override {
    at::Tensor s = staged(out);
    return then(inner_->all_gather_async(staged(in), s), {{s, out}});
  }
  std::unique_ptr<CommWork> reduce_scatter_sum_async(const at::Tensor& in,
                                                     at::Tensor& out) override {
    at::Tensor s = staged(out);
    return then(inner_->reduce_scatter_sum_async(staged(in), s), {{s, out}});
  }

 private:
  using Copies = std::vector<std::pair<at::Tensor, at::Tensor>>;  // staged, original

  bool at_home(const at::Tensor& t) const { return t.device().type() == home_.type(); }
  at::Tensor staged(const at::Tensor& t) const { return at_home(t) ? t : t.to(home_); }
  // The results into the originals that were staged.
  void back(const Copies& copies) const {
    for (const auto& [s, t] : copies)
      if (!at_home(t)) t.copy_(s);
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
