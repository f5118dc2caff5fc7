// The LibTorch face of the fused gradient health check (kernels/gradcheck.h): validates the
// gradient tensors, builds the segment table for the shard this rank owns, and runs the
// one-pass check on the CPU (SIMD, multi-threaded) or on CUDA (one launch, no host sync),
// optionally in parts as the gradient sync's buckets land (run_range).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/gradcheck.h"
#include "tensors.h"

namespace lockstep {

struct GradCheckStats {  // the stats buffer read back on the host
  double nonfinite = 0;
  double sumsq = 0;
  double overflow_runs = 0;
  std::vector<double> tensor_nonfinite, tensor_sumsq;
};

class GradCheck {
 public:
  // Checks the elements [offset, offset + length) of the concatenation of `grads` in order
  // (length -1: to the end). The shard may cut tensors anywhere. Throws std::invalid_argument
  // naming the tensor for an unsupported dtype, a non-contiguous or sparse tensor, or mixed
  // devices.
  explicit GradCheck(std::vector<NamedTensor> grads, int64_t offset = 0, int64_t length = -1);
  ~GradCheck();
  GradCheck(const GradCheck&) = delete;
  GradCheck& operator=(const GradCheck&) = delete;

  // One pass. Returns the fp64 stats buffer (kernels::stats_size(num_tensors()) elements, on
  // the gradients' device; see kernels/gradcheck.h for the layout). On CUDA the call neither
  // allocates nor syncs with the host; the buffer is reused by the next call.
  at::Tensor run();

  // Checks now the blocks of this check that lie whole in [lo, hi) of the concatenation (a
  // bucket of the gradient sync that has landed); the next run() reuses their partial results
  // and checks only the rest, with the same fixed-order reduction: the same bits as without.
  // On CUDA the blocks are the plan's chunks, checked by a launch on the current stream that
  // writes only their results (no host sync). run() must follow.
  void run_range(int64_t lo, int64_t hi);
  // How many blocks the last run() found already checked by run_range.
  int64_t blocks_checked_early() const { return checked_early_; }

  // The speed-of-light baseline for benchmarks: a plain SIMD sum over the same blocks and
  // launch shape, no checks. Asynchronous on CUDA.
  void sum_baseline();

  int num_tensors() const { return static_cast<int>(grads_.size()); }

  static GradCheckStats read(const at::Tensor& stats);

 private:
  void build_table();
  // The CPU check of blocks `which` into partial_ (ATen's thread pool), marked done.
  void check_blocks(const std::vector<int64_t>& which);
  // Throws std::logic_error naming the tensor whose memory moved since build_table().
  void check_pointers() const;

  std::vector<NamedTensor> grads_;
  int64_t offset_, length_;
  std::vector<kernels::Segment> segments_;
  std::vector<kernels::Segment> blocks_;  // segments cut into units (CPU threads, CUDA chunks)
  std::vector<int64_t> block_start_;      // each block's first element in the concatenation
  std::vector<kernels::SpanStats> partial_;  // each block's result (CPU; CUDA: in the plan)
  std::vector<char> done_;                // partial_[b] is this step's (run_range)
  int64_t checked_early_ = 0;
  std::vector<const void*> pointers_;      // each tensor's memory when the table was built
  at::Tensor out_, sum_out_;
  struct Cuda;
  std::unique_ptr<Cuda> cuda_;
};

// The tensors of `tensors` holding nonfinite values, with how many, most first (a pass and a
// read each: for the rare step whose cause may be the model's own parameters).
std::vector<std::pair<std::string, int64_t>> nonfinite_tensors(
    const std::vector<NamedTensor>& tensors);

}  // namespace lockstep
