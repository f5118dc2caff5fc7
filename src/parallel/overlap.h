// The gradient sync in buckets, and its overlap with backward (parallelism.overlap) as PyTorch
// DDP's Reducer does it: a hook on every parameter's gradient accumulator tells when autograd has
// finished that parameter's gradient during the last micro-batch's backward; a bucket's
// collective starts as soon as all its gradients are final and every earlier bucket has started.
// Buckets start in one fixed order on every rank (collectives must), whatever order autograd
// finishes the gradients in; a bucket whose gradient never came (an unused parameter) starts
// when backward has ended. The modes (ddp.cpp, sharded.cpp) say what a bucket is and what
// starting it means.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "tensors.h"

namespace lockstep {

// Calls `ready` each time autograd's AccumulateGrad of `param` (a leaf requiring grad, in its
// final storage: a later set_data to another dtype or device drops the accumulator) has added a
// backward's share into its .grad. Returns the function that removes the hook. Throws
// std::invalid_argument naming `name` for a tensor without a gradient accumulator.
std::function<void()> on_gradient_accumulated(const at::Tensor& param, const std::string& name,
                                              std::function<void()> ready);

class GradientBuckets {
 public:
  // Starts bucket b's collective (after staging what it sends) and returns it in flight.
  using Start = std::function<std::unique_ptr<CommWork>(int bucket)>;

  // `needs[b]`: the indices into `params` of the parameters whose gradients bucket b sends;
  // buckets in start order. With `overlap`, hooks go on the parameters' gradient accumulators
  // (so build this after the parameters have moved to their final storage) and come off with
  // the object; without, finish() sends the same buckets after backward (the same sums).
  // `max_in_flight` > 0: starting one more waits for the oldest first (its copies go), so what
  // a collective holds besides the buffers stays at that many buckets.
  GradientBuckets(const std::vector<NamedTensor>& params, std::vector<std::vector<int>> needs,
                  Start start, bool overlap, int max_in_flight = 0);
  ~GradientBuckets();
  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;

  // The next backward leaves the gradients final: its hooks start buckets. Earlier ones (the
  // other micro-batches) only accumulate.
  void arm();
  // After that backward: starts the buckets not started yet, waits for all in start order
  // (calling `landed(b)` after bucket b's wait) and disarms. Without arm() it starts and waits
  // for all of them (no overlap).
  void finish(const std::function<void(int bucket)>& landed = {});
  // How many buckets the last armed backward started before it ended (0 when not armed).
  int started_during_backward() const { return started_in_backward_; }
  int size() const { return static_cast<int>(pending_.size()); }
  bool overlapped() const { return !unhook_.empty(); }

 private:
  void ready(int param);
  void start_ready();  // with mu_ held: every bucket in order whose gradients are all final
  void start_next();   // with mu_ held: bucket next_, after the oldest when max_in_flight_ are

  std::vector<std::vector<int>> needs_;
  std::vector<std::vector<int>> buckets_of_;  // per parameter: the buckets it is in
  Start start_;
  std::mutex mu_;
  bool armed_ = false;
  std::vector<int> pending_;  // per bucket: gradients not final yet
  int next_ = 0;              // the next bucket to start
  int started_in_backward_ = 0;
  std::vector<std::unique_ptr<CommWork>> works_;
  int max_in_flight_ = 0;
  size_t waited_ = 0;  // works_[0, waited_) have been waited for
  std::vector<std::function<void()>> unhook_;
};

}  // namespace lockstep
