// fsdp (ZeRO-3): the parameters are sharded too. Each unit of the model (units.h: the
// embeddings, each transformer block, the head) is one flat buffer padded to W equal blocks;
// rank r keeps block r of every unit as fp32 master weights with its AdamW moments, and nothing
// else of the weights. A unit's parameters exist whole only while it computes:
//
//   forward   before unit u: its all-gather (in the compute dtype) has landed, the next
//             unit's starts (parallelism.prefetch); after it: u is freed (the head is kept for
//             the backward that follows at once)
//   backward  before unit u (its output's gradient is complete): gathered again, the unit
//             before it prefetched; when the last of u's gradients has accumulated: freed
//   sync      overlap = true: each unit's gradient is reduce-scattered as its last backward
//             ends (one unit in flight) and freed when it has landed, so the unsharded
//             gradient exists a unit at a time (with gradient accumulation it is kept from the
//             first micro-batch to the last, whose backward sends it: the same sums as ddp);
//             overlap = false: the gradients stay in one flat buffer until the sync after
//             backward, so the triage can act on them first (a dropped rank zeroes its own)
//
// The freed buffer keeps its tensors (autograd saved them for backward): only the memory goes
// and comes back (its storage is resized), and the gathers write into it. A unit is one
// all-gather and one reduce-scatter (c10d's flat forms, no staging copies; parallelism.bucket_mb
// does not apply).
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>
#include <fmt/core.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <stdexcept>
#include <utility>

#include "check/gradcheck.h"
#include "checkpoint/safetensors.h"
#include "model/units.h"
#include "parallel/data_parallel.h"
#include "parallel/pages.h"

namespace lockstep {
namespace {

// The memory of a tensor's storage goes (its views stay valid objects) and comes back.
void release_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}
void restore_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == bytes) return;
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

// Takes each unit as the model draws it (on the CPU, fp32): the initial weights filled in if
// any, this rank's block copied to the device, and the parameters turned into views of the
// unit's buffer on the device, which holds no memory yet. The CPU copy goes with the next unit.
class FsdpSink final : public UnitSink {
 public:
  struct Taken {
    at::Tensor full;   // P on the device, W x block, no memory: the parameters view it
    at::Tensor shard;  // fp32 on the device: this rank's block, without the padding
  };
  FsdpSink(int world, int rank, c10::Device device, at::ScalarType param_dtype,
           std::function<void(const std::vector<NamedTensor>&)> fill)
      : world_(world), rank_(rank), device_(device), dtype_(param_dtype), fill_(std::move(fill)) {}

  void take(int unit, const std::vector<NamedTensor>& params) override {
    if (unit != static_cast<int>(taken_.size())) throw std::logic_error("fsdp: units out of order");
    if (fill_) fill_(params);
    int64_t numel = 0;
    for (const auto& p : params) numel += p.tensor.numel();
    const int64_t block = (numel + world_ - 1) / world_;
    const int64_t mine = rank_ * block, own = std::clamp<int64_t>(numel - mine, 0, block);
    Taken t;
    at::Tensor shard = at::empty({own}, at::kFloat);
    t.full = at::empty({world_ * block}, at::TensorOptions().dtype(dtype_).device(device_));
    const c10::AutoGradMode no_grad(false);
    int64_t at_unit = 0;
    for (const auto& p : params) {
      const int64_t n = p.tensor.numel();
      const int64_t lo = std::max(at_unit, mine), hi = std::min(at_unit + n, mine + own);
      if (lo < hi)
        shard.narrow(0, lo - mine, hi - lo).copy_(p.tensor.detach().view({-1}).narrow(0, lo - at_unit, hi - lo));
      p.tensor.set_data(t.full.narrow(0, at_unit, n).view(p.tensor.sizes()));
      at_unit += n;
    }
    release_storage(t.full);  // views made while it had memory (their bounds are checked)
    t.shard = shard.to(device_);
    taken_.push_back(std::move(t));
  }
  std::vector<Taken>& taken() { return taken_; }

 private:
  int world_, rank_;
  c10::Device device_;
  at::ScalarType dtype_;
  std::function<void(const std::vector<NamedTensor>&)> fill_;
  std::vector<Taken> taken_;
};

class Fsdp final : public DataParallel, public UnitHooks {
 public:
  Fsdp(const std::vector<NamedTensor>& params, Comm* comm, const DataParallelOptions& o)
      : DataParallel(params, comm, o, /*flat_gradients=*/false),
        overlap_(o.overlap && world_ > 1),
        prefetch_(o.prefetch),
        local_check_(o.local_check),
        optimizer_(AdamW::over(build(*o.units, o.sink), o.adamw)) {
    o.units->set_hooks(this);
    units_hooked_ = o.units;
    hook_accumulators();
  }
  ~Fsdp() override {
    if (units_hooked_) units_hooked_->set_hooks(nullptr);
    for (auto& u : unhook_) u();
  }

  std::string describe() const override {
    return fmt::format(
        "fsdp (ZeRO-3: this rank owns {} of {} parameters in {} units{}{})", owned_, total_,
        units_.size(), prefetch_ ? ", next unit prefetched" : "",
        overlap_ ? ", gradients reduce-scattered during backward" : "");
  }
  bool fused_optimizer() const override { return optimizer_.fused(); }

  // Every rank built the same weights from the same seed (or read the same checkpoint or
  // folder): its master blocks are its own already; only the compute-dtype copy follows.
  void replicate_parameters() override { refresh_param_shard(); }

  // ---- the units (UnitHooks) ----------------------------------------------------------------
  void before_forward(int u) override {
    gathered(u);
    if (units_[u].reads >= 0) gathered(units_[u].reads);  // a tied head: the embedding again
    if (prefetch_ && u + 1 < static_cast<int>(units_.size())) start_gather(u + 1);
  }
  void after_forward(int u) override {
    const bool backward_next = c10::GradMode::is_enabled() && u + 1 == static_cast<int>(units_.size());
    if (backward_next) return;  // the head (and what it reads) stays for the backward
    release(u);
    if (units_[u].reads >= 0) release(units_[u].reads);
  }
  void before_backward(int u) override {
    if (u + 1 == static_cast<int>(units_.size()))  // the head's: a backward begins
      for (Unit& x : units_) x.pending = static_cast<int>(x.params.size());
    gathered(u);
    // A tied unit stays gathered until its own backward, its gradients' last.
    if (units_[u].reads >= 0) gathered(units_[u].reads);
    if (prefetch_ && u > 0) start_gather(u - 1);
    if (overlap_ && !units_[u].grad.defined()) allocate_gradient(units_[u]);
  }

  void sync_gradients(int contributors) override {
    if (overlap_) {
      if (contributors != world_)
        throw std::logic_error("fsdp with overlap reduced every rank's gradient during backward");
      finish_backward();
    } else {
      release_all();  // a backward that ended early (an error) leaves no unit gathered
      stage_for_reduction();
      for (size_t u = 0; u < units_.size(); ++u) {
        reduce_scatter(static_cast<int>(u), reduce_.narrow(0, units_[u].start, world_ * units_[u].block));
        if (in_flight_.size() > 2) land_oldest(contributors);
      }
      while (!in_flight_.empty()) land_oldest(contributors);
    }
    if (opt_grad_.defined()) opt_grad_.copy_(grad_shard_);
  }

  void begin_last_backward() override {
    if (!overlap_) return;
    armed_ = true;
    next_send_ = static_cast<int>(units_.size()) - 1;
    for (Unit& x : units_) x.local_stats = at::Tensor();
  }

  bool checks_local() const override { return overlap_; }
  bool collective_forward() const override { return true; }
  // The gathers of a forward and a backward, as the hooks issue them, with nothing computed.
  void bystand_computation() override {
    const int n = static_cast<int>(units_.size());
    const c10::AutoGradMode grad(true);  // a training forward: the head is kept for backward
    for (int u = 0; u < n; ++u) before_forward(u), after_forward(u);
    for (int u = n - 1; u >= 0; --u) {
      gathered(u);
      if (prefetch_ && u > 0) start_gather(u - 1);
      release(u);
    }
  }
  at::Tensor local_stats() override {
    std::vector<at::Tensor> headers, tensors;
    for (Unit& x : units_) {
      if (!x.local_stats.defined()) throw std::logic_error("fsdp: a unit's check [A] did not run");
      headers.push_back(x.local_stats.narrow(0, 0, kernels::kStatsHeader));
      tensors.push_back(x.local_stats.narrow(0, kernels::kStatsHeader,
                                             x.local_stats.numel() - kernels::kStatsHeader));
    }
    tensors.insert(tensors.begin(), at::stack(headers).sum(0));
    return at::cat(tensors);
  }

  AdamW& optimizer() override { return optimizer_; }
  void apply(double lr, const UpdateControl& control) override {
    optimizer_.step(lr, control);
    if (!control.skip || control.on_device()) refresh_param_shard();
    // The next step's reduce-scatters overwrite every block: until its units land, the
    // gradient shard needs no memory (FSDP2's zero_grad frees its sharded gradients too).
    release_pages(grad_shard_);
  }

  WeightSource weights() override {
    return {params_, [this](int64_t lo, int64_t n, float* dst) { gather_weights(lo, n, dst); }};
  }
  OptimizerPart optimizer_part(int64_t optimizer_steps) override;
  void load(CheckpointReader& reader) override;
  std::vector<NamedTensor> replicated_optimizer_state() const override { return {}; }
  std::vector<NamedTensor> replicated_parameters() const override { return {}; }
  std::vector<NamedTensor> held_parameters() const override;
  uint32_t parameters_crc32() override;

 private:
  struct Unit {
    std::vector<int> params;  // indices into params_, model order
    int64_t offset = 0, numel = 0;  // its elements in the flat space of the parameters
    int64_t block = 0;       // per rank: the unit is W x block elements, padded
    int64_t start = 0;       // its first element in the gradient buffer (overlap = false)
    int64_t shard_at = 0;    // this rank's block in the shard buffers
    int64_t own = 0;         // elements of this rank's block that are not padding
    int64_t checked_at = 0;  // those elements' first position in the pieces check [B] reads
    at::Tensor full;         // P, W x block: the gathered parameters (no memory when freed)
    bool gathered = false;
    std::unique_ptr<CommWork> gathering;  // an all-gather in flight
    at::Tensor grad;         // overlap: this step's unsharded gradient (P, W x block)
    at::Tensor local_stats;  // overlap: check [A] of `grad`, taken before it was sent
    int pending = 0;         // gradients of this backward not accumulated yet
    int reads = -1;          // the unit whose parameters it also reads (a tied head), or -1
  };

  std::vector<AdamWParam> build(const Units& units, UnitSink* sink);
  void lay_out(const Units& units);
  void hook_accumulators();
  void ready(int param);

  void start_gather(int u);
  void gathered(int u);
  void release(int u);
  void release_all() {
    for (size_t u = 0; u < units_.size(); ++u) release(static_cast<int>(u));
  }
  void refresh_param_shard() {
    if (param_shard_.defined()) param_shard_.copy_(master_);
  }
  // One rank whose gradients are reduced in their own dtype: the reduced shard is the
  // gradient buffer (units lie back to back, unpadded).
  bool alone() const { return world_ == 1 && reduce_dtype_ == param_dtype_; }

  void allocate_gradient(Unit& x);
  void drop_gradient(Unit& x);
  // The unit's parameters' places in one of its W x block buffers, named and shaped like them.
  std::vector<NamedTensor> views_in(const Unit& x, const at::Tensor& unit_flat) const;
  void send_ready();
  void reduce_scatter(int u, const at::Tensor& unit_grad);
  void land_oldest(int contributors);
  void finish_backward();

  void gather_weights(int64_t lo, int64_t n, float* dst);

  bool overlap_, prefetch_;
  bool local_check_;  // overlap: check [A] each unit's gradient before it is sent
  std::vector<Unit> units_;
  std::vector<int> unit_of_;  // per parameter
  int64_t owned_ = 0;
  at::Tensor master_;       // fp32: this rank's blocks of every unit, what AdamW updates
  at::Tensor param_shard_;  // P != fp32: the masters in P, what the all-gathers send
  at::Tensor grad_shard_;   // R: the reduce-scatters' results, then their mean
  at::Tensor opt_grad_;     // R != fp32: the mean in fp32 for AdamW
  at::Tensor exp_avg_, exp_avg_sq_;
  at::Tensor shard_steps_ = at::zeros({}, at::kFloat);
  std::deque<std::pair<int, std::unique_ptr<CommWork>>> in_flight_;  // reduce-scatters
  bool armed_ = false;  // overlap: this backward is the step's last (it sends the gradients)
  int next_send_ = -1;  // overlap: the next unit to reduce-scatter (units go last to first)
  Units* units_hooked_ = nullptr;
  std::vector<std::function<void()>> unhook_;
  AdamW optimizer_;
};

// The units' places: in the flat parameter space (model order), in the padded gradient
// buffer, in this rank's shard buffers, and in the pieces check [B] reads.
void Fsdp::lay_out(const Units& units) {
  unit_of_.assign(params_.size(), -1);
  int64_t offset = 0, start = 0, shard = 0, checked = 0;
  for (int u = 0; u < units.size(); ++u) {
    Unit x;
    x.params = units.params(u);
    x.reads = units.also_reads(u);
    x.offset = offset;
    for (int p : x.params) {
      if (p < 0 || p >= static_cast<int>(params_.size()) || unit_of_[p] != -1)
        throw std::invalid_argument("fsdp: the model's units do not partition its parameters");
      unit_of_[p] = u;
      x.numel += params_[p].tensor.numel();
    }
    x.block = (x.numel + world_ - 1) / world_;
    x.start = start;
    x.shard_at = shard;
    x.own = std::clamp<int64_t>(x.numel - rank_ * x.block, 0, x.block);
    x.checked_at = checked;
    offset += x.numel;
    start += world_ * x.block;
    shard += x.block;
    checked += x.own;
    owned_ += x.own;
    units_.push_back(std::move(x));
  }
  for (int p = 0; p < static_cast<int>(params_.size()); ++p)
    if (unit_of_[p] == -1) throw std::invalid_argument("fsdp: " + params_[p].name + " is in no unit");
  shard_offset_ = 0;
  shard_length_ = checked;
}

// Buffers, the masters from the blocks the sink kept (the parameters already view their units'
// buffers), the gradient views, the pieces check [B] reads, and the optimizer's pieces.
std::vector<AdamWParam> Fsdp::build(const Units& units, UnitSink* sink) {
  auto* taken = dynamic_cast<FsdpSink*>(sink);
  if (!taken || taken->taken().size() != static_cast<size_t>(units.size()))
    throw std::invalid_argument("fsdp: build the model with make_fsdp_sink's sink");
  lay_out(units);
  const auto options = params_.at(0).tensor.options().requires_grad(false);
  const auto fp32 = options.dtype(at::kFloat);
  int64_t shard = 0, padded = 0;
  for (const Unit& x : units_) shard += x.block, padded += world_ * x.block;
  master_ = at::zeros({shard}, fp32);
  if (param_dtype_ != at::kFloat) param_shard_ = at::empty({shard}, options.dtype(param_dtype_));
  grad_shard_ = returnable_zeros(shard, options.dtype(reduce_dtype_));
  if (reduce_dtype_ != at::kFloat) opt_grad_ = at::zeros({shard}, fp32);
  exp_avg_ = at::zeros({shard}, fp32);
  exp_avg_sq_ = at::zeros({shard}, fp32);
  if (!overlap_) {
    // One rank's reduce-scatter is the identity: its shard is the whole gradient buffer, so
    // fsdp on one rank holds one gradient, as ddp does (issue 39: it held two, 1.2x ddp).
    flat_grad_ = alone() ? grad_shard_ : returnable_zeros(padded, options.dtype(param_dtype_));
    reduce_ = reduce_dtype_ == param_dtype_ ? flat_grad_ : at::zeros({padded}, options.dtype(reduce_dtype_));
  }
  const at::Tensor opt_grads = opt_grad_.defined() ? opt_grad_ : grad_shard_;
  std::vector<AdamWParam> out;
  const c10::AutoGradMode no_grad(false);
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& x = units_[u];
    x.full = taken->taken()[u].full;
    master_.narrow(0, x.shard_at, x.own).copy_(taken->taken()[u].shard);
    taken->taken()[u].shard = at::Tensor();
    const int64_t mine = rank_ * x.block;  // this rank's block within the unit
    int64_t at_unit = 0;
    for (int p : x.params) {
      const at::Tensor& t = params_[p].tensor;
      const int64_t n = t.numel();
      const int64_t lo = std::max(at_unit, mine), hi = std::min(at_unit + n, mine + x.own);
      const int64_t piece = std::max<int64_t>(0, hi - lo);
      const int64_t in_shard = x.shard_at + (piece > 0 ? lo - mine : 0);
      if (!overlap_) {
        const at::Tensor g = flat_grad_.narrow(0, x.start + at_unit, n).view(t.sizes());
        t.mutable_grad() = g;
        grads_.push_back({params_[p].name, g});
      } else {
        grads_.push_back(params_[p]);  // names and shapes only: the gradient is transient
      }
      synced_.push_back({params_[p].name, grad_shard_.narrow(0, in_shard, piece)});
      if (piece > 0)
        out.push_back({params_[p].name, master_.narrow(0, in_shard, piece),
                       opt_grads.narrow(0, in_shard, piece), exp_avg_.narrow(0, in_shard, piece),
                       exp_avg_sq_.narrow(0, in_shard, piece), t.dim() >= 2});
      at_unit += n;
    }
  }
  refresh_param_shard();
  return out;
}

void Fsdp::hook_accumulators() {
  for (size_t i = 0; i < params_.size(); ++i)
    unhook_.push_back(on_gradient_accumulated(params_[i].tensor, "fsdp: " + params_[i].name,
                                              [this, i] { ready(static_cast<int>(i)); }));
}

// ---- gathering -----------------------------------------------------------------------------

// Starts unit u's all-gather into its buffer (memory back first), unless it is there or coming.
void Fsdp::start_gather(int u) {
  Unit& x = units_[u];
  if (x.gathered || x.gathering) return;
  restore_storage(x.full);
  const at::Tensor source = (param_shard_.defined() ? param_shard_ : master_).narrow(0, x.shard_at, x.block);
  if (!comm_) {
    x.full.copy_(source);
    x.gathered = true;
    return;
  }
  at::Tensor out = x.full;  // one flat call per unit: no staging copy of a list of views
  x.gathering = comm_->all_gather_async(source, out);
}

// Unit u's parameters hold their values once this returns.
void Fsdp::gathered(int u) {
  Unit& x = units_[u];
  start_gather(u);
  if (x.gathering) x.gathering->wait();
  x.gathering.reset();
  x.gathered = true;
}

void Fsdp::release(int u) {
  Unit& x = units_[u];
  if (x.gathering) x.gathering->wait();  // a prefetch the forward did not use (an error)
  x.gathering.reset();
  if (!x.gathered) return;
  release_storage(x.full);
  x.gathered = false;
}

// ---- gradients -----------------------------------------------------------------------------

// Overlap: the unit's unsharded gradient for this step, zero, its parameters' .grad into it.
void Fsdp::allocate_gradient(Unit& x) {
  x.grad = at::zeros({world_ * x.block}, x.full.options());
  const c10::AutoGradMode no_grad(false);
  const std::vector<NamedTensor> views = views_in(x, x.grad);
  for (size_t i = 0; i < x.params.size(); ++i)
    params_[x.params[i]].tensor.mutable_grad() = views[i].tensor;
}

// Overlap: the parameters' .grad let go of the unit's unsharded gradient (x.grad, still sent
// or staged, is the caller's).
void Fsdp::drop_gradient(Unit& x) {
  const c10::AutoGradMode no_grad(false);
  for (int p : x.params) params_[p].tensor.mutable_grad() = at::Tensor();
}

std::vector<NamedTensor> Fsdp::views_in(const Unit& x, const at::Tensor& unit_flat) const {
  std::vector<NamedTensor> out;
  int64_t at_unit = 0;
  for (int p : x.params) {
    const at::Tensor& t = params_[p].tensor;
    out.push_back({params_[p].name, unit_flat.narrow(0, at_unit, t.numel()).view(t.sizes())});
    at_unit += t.numel();
  }
  return out;
}

// This rank's block of each unit in its master shard, cut at the parameters' bounds.
std::vector<NamedTensor> Fsdp::held_parameters() const {
  std::vector<NamedTensor> out;
  for (const Unit& x : units_) {
    const int64_t lo = rank_ * x.block, hi = lo + x.own;
    int64_t at_unit = 0;
    for (int p : x.params) {
      const int64_t n = params_[p].tensor.numel();
      const int64_t a = std::max(lo, at_unit), b = std::min(hi, at_unit + n);
      if (a < b) out.push_back({params_[p].name, master_.narrow(0, x.shard_at + a - lo, b - a)});
      at_unit += n;
    }
  }
  return out;
}

// After one parameter's gradient accumulated: a unit whose gradients all have is freed, and in
// the last backward (overlap) sent.
void Fsdp::ready(int param) {
  Unit& x = units_[unit_of_[param]];
  if (--x.pending > 0) return;
  release(unit_of_[param]);
  if (armed_) send_ready();
}

// Overlap: reduce-scatters the units whose gradients are final, last unit first (the same order
// on every rank whatever order autograd finishes them in); at most one unit in flight.
void Fsdp::send_ready() {
  while (next_send_ >= 0 && units_[next_send_].pending <= 0) {
    Unit& x = units_[next_send_];
    // check [A] of this rank's own gradient of the unit, before it goes
    if (local_check_) x.local_stats = GradCheck(views_in(x, x.grad)).run().clone();
    reduce_scatter(next_send_, x.grad);
    --next_send_;
    if (in_flight_.size() > 1) land_oldest(world_);
  }
}

// Starts unit u's reduce-scatter of `unit_grad` (W x block; P is staged into R first), one flat
// call per unit.
void Fsdp::reduce_scatter(int u, const at::Tensor& unit_grad) {
  Unit& x = units_[u];
  at::Tensor send = unit_grad;
  if (send.scalar_type() != reduce_dtype_) send = unit_grad.to(reduce_dtype_);
  std::unique_ptr<CommWork> work;
  at::Tensor out = grad_shard_.narrow(0, x.shard_at, x.block);
  if (alone()) {
    // the buffer is its own result
  } else if (comm_) {
    work = comm_->reduce_scatter_sum_async(send, out);
  } else {
    out.copy_(send);
  }
  if (overlap_ && !send.is_same(unit_grad)) {  // only the staged copy stays until it lands
    x.grad = send;
    drop_gradient(x);
  }
  in_flight_.emplace_back(u, std::move(work));
}

// The oldest unit in flight lands: its mean, check [B] of it, its unsharded gradient freed.
void Fsdp::land_oldest(int contributors) {
  auto [u, work] = std::move(in_flight_.front());
  in_flight_.pop_front();
  if (work) work->wait();
  Unit& x = units_[u];
  grad_shard_.narrow(0, x.shard_at, x.block).div_(static_cast<double>(contributors));
  if (landed_) landed_(x.checked_at, x.checked_at + x.own);
  if (!overlap_) return;
  x.grad = at::Tensor();
  drop_gradient(x);
}

// Overlap, after the last backward: the units not sent yet (a parameter without a gradient, or
// a backward cut short) go now, and every unit lands.
void Fsdp::finish_backward() {
  if (!armed_) begin_last_backward();
  // Units not sent yet that got no gradient send zeros. (Those sent have landed and let go of
  // theirs: zeros allocated for them stayed resident until the next step, the whole model's
  // gradient again; issue 39.)
  for (int u = 0; u <= next_send_; ++u)
    if (!units_[u].grad.defined()) allocate_gradient(units_[u]);
  for (Unit& x : units_) x.pending = 0;
  send_ready();
  while (!in_flight_.empty()) land_oldest(world_);
  armed_ = false;
  release_all();
}

// ---- checkpoints ---------------------------------------------------------------------------

// Elements [lo, lo + n) of the flat fp32 weights into dst on every rank: piece by piece, each
// broadcast by the rank whose master block holds it.
void Fsdp::gather_weights(int64_t lo, int64_t n, float* dst) {
  for (const Unit& x : units_) {
    for (int r = 0; r < world_; ++r) {
      const int64_t first = x.offset + r * x.block;  // rank r's block in the flat space
      const int64_t len = std::clamp<int64_t>(x.numel - r * x.block, 0, x.block);
      const int64_t a = std::max(lo, first), b = std::min(lo + n, first + len);
      if (a >= b) continue;
      at::Tensor piece = master_.narrow(0, x.shard_at + (a - first), b - a);
      if (comm_) {
        at::Tensor buf = r == rank_ ? piece.clone() : at::empty({b - a}, master_.options());
        comm_->broadcast(buf, r);
        piece = buf;
      }
      at::from_blob(dst + (a - lo), {b - a}, at::kFloat).copy_(piece);
    }
  }
}

// This rank's block of each unit: "exp_avg.<u>", "exp_avg_sq.<u>" over its range of the flat
// space (empty where the rank's block is padding only), and one "step".
OptimizerPart Fsdp::optimizer_part(int64_t optimizer_steps) {
  shard_steps_.fill_(static_cast<double>(optimizer_steps));
  OptimizerPart part{OptimizerLayout::kUnitShards, {}, {}};
  for (size_t u = 0; u < units_.size(); ++u) {
    const Unit& x = units_[u];
    part.ranges.emplace_back(x.offset + rank_ * x.block, x.own);
    part.tensors.push_back({"exp_avg." + std::to_string(u), exp_avg_.narrow(0, x.shard_at, x.own)});
    part.tensors.push_back({"exp_avg_sq." + std::to_string(u),
                            exp_avg_sq_.narrow(0, x.shard_at, x.own)});
  }
  part.tensors.push_back({"step", shard_steps_});
  return part;
}

// This rank's blocks from any checkpoint (any mode, any world size): masters, then moments.
void Fsdp::load(CheckpointReader& reader) {
  for (const Unit& x : units_) {
    if (x.own == 0) continue;
    const int64_t first = x.offset + rank_ * x.block;
    reader.fill_weights(master_.narrow(0, x.shard_at, x.own), first);
    reader.fill_moment(exp_avg_.narrow(0, x.shard_at, x.own), "exp_avg", first);
    reader.fill_moment(exp_avg_sq_.narrow(0, x.shard_at, x.own), "exp_avg_sq", first);
  }
  optimizer_.set_step_count(reader.step());
}

// The CRC32 of the parameters as the model computes with them, a unit gathered at a time.
uint32_t Fsdp::parameters_crc32() {
  uint32_t crc = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    gathered(static_cast<int>(u));
    crc = tensors_crc32_value(views_in(units_[u], units_[u].full), crc);
    release(static_cast<int>(u));
  }
  return crc;
}

}  // namespace

std::unique_ptr<UnitSink> make_fsdp_sink(Comm* comm, c10::Device device, at::ScalarType param_dtype,
                                         std::function<void(const std::vector<NamedTensor>&)> fill) {
  return std::make_unique<FsdpSink>(comm ? comm->size() : 1, comm ? comm->rank() : 0, device,
                                    param_dtype, std::move(fill));
}

std::unique_ptr<DataParallel> make_fsdp(const std::vector<NamedTensor>& params, Comm* comm,
                                        const DataParallelOptions& options) {
  if (!options.units) throw std::invalid_argument("fsdp: the model's units are needed");
  return std::make_unique<Fsdp>(params, comm, options);
}

}  // namespace lockstep
