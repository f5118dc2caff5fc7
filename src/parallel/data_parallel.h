// Data parallelism: one interface, one implementation per mode (ddp.cpp, sharded.cpp, fsdp.cpp), each
// owning its gradient sync, the range its gradient check [B] reads, its optimizer, the update
// (and gather), and what it saves in and reads from a checkpoint.
//
// Both lay the parameters out flat: model order, padded to W equal blocks; rank r owns block
// r, the elements [r * block, (r + 1) * block) of the flat space. Every parameter's .grad is a
// view into one flat gradient buffer.
//
// Mixed precision: the model computes in the parameter dtype P (training.mixed_precision_param:
// its weights, activations and gradients), gradients are reduced and checked [B] in the reduce
// dtype R (mixed_precision_reduce), and the optimizer updates fp32 master weights with fp32
// moments from fp32 gradients; the P-dtype weights are copies of the masters, refreshed after
// every update. With P = R = fp32 nothing is copied: the optimizer updates the parameters.
//  ddp      one all-reduce averages the whole buffer; parameters and optimizer state are
//           replicated; each rank checks its 1/W block of the synced gradient.
//  sharded  (ZeRO-2) the buffer is reduce-scattered: rank r receives the mean of block r only,
//           and only rank r keeps fp32 master weights and AdamW moments for it. After the
//           update the blocks are all-gathered into every rank's parameters, which are views
//           into one flat parameter buffer. Optimizer memory is 1/W of ddp's.
//  fsdp     (ZeRO-3, fsdp.cpp) the parameters are sharded too, unit by unit (the model's
//           units: embeddings, blocks, head), and gathered only while a unit computes.
// In ddp and sharded, after every step the parameters are bitwise identical on all ranks.
//
// Both sync in buckets (overlap.h). Overlap (parallelism.overlap): the collective of a bucket
// starts during the last micro-batch's backward, as soon as autograd has finished its
// gradients; the sync then only waits. The buckets are the same either way, and so are the
// sums. ddp then reduces into a buffer of its own (one more gradient-sized buffer, as PyTorch
// DDP's buckets), so the local gradient stays readable for check [A].
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/checkpointer.h"
#include "comm/comm.h"
#include "lockstep/config.h"
#include "optim/adamw.h"
#include "model/model.h"
#include "model/units.h"
#include "parallel/overlap.h"
#include "tensors.h"

namespace lockstep {

struct DataParallelOptions {
  ParallelMode mode = ParallelMode::kDdp;
  // Bytes of gradient per collective call. ddp: whole parameters, from the last back. Sharded:
  // all ranks' blocks together, so the backends' staging buffers (Gloo flattens its list
  // arguments) stay that small.
  int64_t bucket_bytes = 16 << 20;
  bool overlap = false;  // start buckets during the last backward (more than one rank)
  AdamWOptions adamw;
  at::ScalarType param_dtype = at::kFloat;   // P: forward, backward, the gradient buffer
  at::ScalarType reduce_dtype = at::kFloat;  // R: the reduction and check [B]
  bool prefetch = true;     // fsdp: gather the next unit while this one computes
  bool local_check = true;  // fsdp with overlap: check [A] each unit before it is sent
  Units* units = nullptr;   // fsdp: the model's units (it hooks into them)
  UnitSink* sink = nullptr;  // fsdp: what make_fsdp_sink built the model into
};

class DataParallel {
 public:
  virtual ~DataParallel() = default;
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // E.g. "ddp data parallel" or "sharded data parallel (this rank owns N of M parameters)".
  virtual std::string describe() const = 0;
  virtual bool fused_optimizer() const = 0;

  // Every rank starts from rank 0's weights (a broadcast); then the mode's own copies follow
  // the parameters. Call it after building and after loading a checkpoint.
  virtual void replicate_parameters();

  // After backward: the average over ranks of the part of the gradient this rank checks and
  // updates (ddp: all of it; sharded: its block; the rest is stale). `contributors`: the ranks
  // whose gradient counts (a salvage: the dropped ones zeroed theirs); every rank holds as many
  // tokens, so the mean over their tokens is the sum divided by it.
  virtual void sync_gradients(int contributors) = 0;

  // Called by sync_gradients with each flat range [lo, hi) of the synced gradient as it lands,
  // mean taken (ddp's buckets, sharded's slices of this rank's block: check [B] runs on it while
  // later ones are in flight).
  void on_landed(std::function<void(int64_t lo, int64_t hi)> landed) {
    landed_ = std::move(landed);
  }

  // Overlap: the next backward is the last before the sync (its hooks start the buckets).
  virtual void begin_last_backward() {
    if (buckets_ && buckets_->overlapped()) buckets_->arm();
  }
  // The mode checks [A] itself (fsdp with overlap: each unit before its gradient goes, the
  // only time this rank's whole gradient of the unit exists); local_stats() then gives the
  // stats after backward, laid out as one check over grads() would.
  virtual bool checks_local() const { return false; }
  // The collectives of one forward and backward that another rank computes (fsdp: its
  // gathers, in the same order); nothing in ddp and sharded.
  virtual void bystand_computation() {}
  // Every forward is collective (fsdp: it gathers parameters with every rank), so no rank may
  // stop a batch alone or run fewer forwards than the others; ddp and sharded forward alone.
  virtual bool collective_forward() const { return false; }
  virtual at::Tensor local_stats() { return {}; }
  // The gradient sync's buckets (null with one rank, and in sharded mode without overlap).
  const GradientBuckets* buckets() const { return buckets_.get(); }

  // The update at learning rate `lr` under `control` (a skip changes nothing anywhere).
  virtual void apply(double lr, const UpdateControl& control) = 0;
  // The optimizer over this rank's part (per-tensor policies act on it before apply).
  virtual AdamW& optimizer() = 0;
  // Zeros the local gradients; on the CPU their memory goes until backward writes them again
  // (pages.h).
  void zero_grad();
  // The buffer every .grad is a view of (a replay saves and restores it).
  const at::Tensor& gradient_buffer() const { return flat_grad_; }

  // Checkpoints hold the fp32 weights (the masters), named like the parameters: what a save
  // writes (in sharded mixed precision gathered piece by piece from the master blocks while
  // rank 0 writes them, so no rank holds a second copy of the model), and this rank's part of
  // the optimizer.
  virtual WeightSource weights() = 0;
  virtual OptimizerPart optimizer_part(int64_t optimizer_steps) = 0;
  // Reads this rank's weights and moments from any checkpoint (any world size, either mode);
  // replicate_parameters() then spreads them.
  virtual void load(CheckpointReader& reader) = 0;
  // The optimizer state every rank holds a replica of (ddp: all; sharded, fsdp: none), and the
  // parameters (ddp, sharded: all; fsdp: none) — what diagnostics.verify_every compares.
  virtual std::vector<NamedTensor> replicated_optimizer_state() const = 0;
  virtual std::vector<NamedTensor> replicated_parameters() const { return params_; }
  // The parameters' elements this rank holds, named (fsdp: its shard of each): what a check
  // of the model's own values reads.
  virtual std::vector<NamedTensor> held_parameters() const { return params_; }
  // The CRC32 of the parameters as the model computes with them (fsdp: a collective).
  virtual uint32_t parameters_crc32();

  // This rank's block within the unpadded flat space: its gradient check [B] reads it.
  int64_t shard_offset() const { return shard_offset_; }
  int64_t shard_length() const { return shard_length_; }
  int64_t total() const { return total_; }
  // The gradients, views into the flat buffer, in model order and named like the parameters
  // (dtype P; check [A] reads them before the sync). fsdp with overlap keeps no such buffer:
  // there these are the parameters, for their names and shapes only.
  const std::vector<NamedTensor>& grads() const { return grads_; }
  // The same positions of the buffer the reduction leaves its result in (dtype R; check [B]
  // reads this rank's range of it after the sync). grads() itself when R = P.
  const std::vector<NamedTensor>& synced_grads() const { return synced_; }

 protected:
  // Lays out the flat gradient buffers (W x block, padded) and points every .grad into one;
  // with flat_gradients = false the mode lays out its own (fsdp).
  DataParallel(const std::vector<NamedTensor>& params, Comm* comm,
               const DataParallelOptions& options, bool flat_gradients = true);

  // Named views of a flat buffer laid out like the parameters (model order).
  std::vector<NamedTensor> views_of(const at::Tensor& flat) const;
  // Moves the parameters into a new flat buffer of dtype P and `size` elements (values cast,
  // padding zero), after copying the fp32 values of the flat range [lo, lo + master.numel())
  // into `master` (exact: the masters start from the fp32 initialisation). Each old storage is
  // released right after its copy, so this never holds a second full copy of the model.
  at::Tensor move_parameters(int64_t size, const at::Tensor& master, int64_t lo);
  // Casts the local gradients into the reduce buffer (when R differs from P).
  void stage_for_reduction();
  // ", gradient sync overlapped with backward (N buckets)" or "" (for describe()).
  std::string overlap_note() const;
  // The indices of the parameters with elements in the flat range [lo, hi).
  std::vector<int> params_in(int64_t lo, int64_t hi) const;

  Comm* comm_;  // null: one rank
  int world_ = 1, rank_ = 0;
  int64_t total_ = 0, block_ = 0;
  int64_t shard_offset_ = 0, shard_length_ = 0;
  at::ScalarType param_dtype_, reduce_dtype_;
  at::Tensor flat_grad_;  // P, W x block (padded): every .grad is a view
  at::Tensor reduce_;     // R, W x block: what the collective reduces; flat_grad_ when R = P
  std::vector<NamedTensor> params_, grads_, synced_;
  std::unique_ptr<GradientBuckets> buckets_;  // more than one rank
  std::function<void(int64_t, int64_t)> landed_;  // on_landed
};

// The implementation of `options.mode`. `comm` may be null (one rank).
std::unique_ptr<DataParallel> make_data_parallel(const std::vector<NamedTensor>& params,
                                                 Comm* comm, const DataParallelOptions& options);

// The modes (ddp.cpp, sharded.cpp, fsdp.cpp); make_data_parallel picks one.
std::unique_ptr<DataParallel> make_ddp(const std::vector<NamedTensor>& params, Comm* comm,
                                       const DataParallelOptions& options);
std::unique_ptr<DataParallel> make_sharded(const std::vector<NamedTensor>& params, Comm* comm,
                                           const DataParallelOptions& options);
std::unique_ptr<DataParallel> make_fsdp(const std::vector<NamedTensor>& params, Comm* comm,
                                        const DataParallelOptions& options);
// fsdp's sink for make_model: each unit's block kept on `device`, the rest let go as the model
// is drawn, so no rank ever holds the whole model; `fill` (optional) writes initial weights
// into a unit's parameters first.
std::unique_ptr<UnitSink> make_fsdp_sink(Comm* comm, c10::Device device, at::ScalarType param_dtype,
                                         std::function<void(const std::vector<NamedTensor>&)> fill);

}  // namespace lockstep
