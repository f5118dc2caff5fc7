// Data parallelism over one flat layout of the parameters: model order, padded to W equal
// blocks; rank r owns block r, the elements [r * block, (r + 1) * block) of the flat space.
//
//  ddp      every parameter's .grad is a view into one flat fp32 buffer, so one all-reduce
//           averages them all with no copy; parameters and optimizer state are replicated.
//  sharded  (ZeRO-2 style) the gradients are reduce-scattered: rank r receives the mean of
//           block r only, and only rank r keeps fp32 master weights and AdamW moments for it.
//           After the update, the blocks are all-gathered into every rank's parameters, which
//           are views into one flat parameter buffer. Optimizer memory is 1/W of ddp's.
//
// Either way the gradient check [B] reads this rank's block, and after every step the
// parameters are bitwise identical on all ranks.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

#include "comm.h"
#include "optim.h"
#include "tensors.h"

namespace lockstep {

class DataParallel {
 public:

  // `comm` may be null (one rank). In sharded mode the parameters are moved into the flat
  // parameter buffer (their values are kept), and the collectives move at most `bucket_bytes`
  // per call (all ranks' blocks together), so the backends' staging buffers (Gloo flattens
  // its list arguments) stay that small.
  DataParallel(const std::vector<NamedTensor>& params, Comm* comm, bool sharded,
               int64_t bucket_bytes = 16 << 20);

  bool sharded() const { return sharded_; }

  // After backward: ddp averages the whole gradient buffer (all-reduce); sharded leaves the
  // average of this rank's block in the buffer (reduce-scatter); the rest is stale.
  void sync_gradients();

  // The tensors the optimizer updates: ddp the parameters themselves, with zeroed moments;
  // sharded the pieces of this rank's master block (one per parameter it intersects, named
  // like it, decay as the parameter's), gradients and moments as views of flat blocks.
  std::vector<AdamWParam> optimizer_params();

  // Sharded: this rank's master block (updated by the optimizer) -> every rank's parameters,
  // one all-gather. Also call it after the parameters changed elsewhere (load, broadcast) with
  // `from_params` = true: then the master block is first copied from the parameters.
  void gather_parameters(bool from_params = false);

  void zero_grad();

  // This rank's block within the unpadded flat space (the gradient check reads it, sharded
  // checkpoints store it).
  int64_t shard_offset() const { return shard_offset_; }
  int64_t shard_length() const { return shard_length_; }
  int64_t total() const { return total_; }
  const std::vector<NamedTensor>& grads() const { return grads_; }

  // Sharded: this rank's moments over its block (shard_length elements each), flat.
  const at::Tensor& exp_avg_block() const { return exp_avg_; }
  const at::Tensor& exp_avg_sq_block() const { return exp_avg_sq_; }

 private:
  // Elements [from, from + n) of every rank's block of `flat`, in rank order.
  std::vector<at::Tensor> rank_blocks(const at::Tensor& flat, int64_t from, int64_t n) const;
  // Runs `start(from, n)` for each bucket of the block, two collectives in flight, all waited.
  void in_buckets(const std::function<std::unique_ptr<CommWork>(int64_t from, int64_t n)>& start);

  Comm* comm_;
  bool sharded_;
  int world_ = 1, rank_ = 0;
  int64_t total_ = 0, block_ = 0, bucket_ = 1;  // bucket_: elements per rank per call
  at::Tensor flat_grad_;                          // W x block (padded)
  at::Tensor flat_param_, master_, grad_block_;   // sharded only
  at::Tensor exp_avg_, exp_avg_sq_;               // sharded only, shard_length each
  std::vector<NamedTensor> params_, grads_;
  int64_t shard_offset_ = 0, shard_length_ = 0;
};

}  // namespace lockstep
