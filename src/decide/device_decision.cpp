#include "decide/device_decision.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <stdexcept>

#include "decide/exchange.h"
#include "decide/names.h"
#include "lockstep/error.h"

#ifdef LOCKSTEP_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace lockstep {

// One step's result on the device and its copy on the host (pinned on a GPU).
struct DeviceDecision::Slot {
  explicit Slot(c10::DeviceType type) : copied(type) {}
  at::Tensor result, flags;             // device: DecideResult bytes; found_inf, grad_scale
  at::Tensor tensor_flags;              // device: per tensor, the factors then the resets
  at::Tensor table_host, result_host, flags_host, tensor_flags_host;
  int64_t step = -1;
  c10::Event copied;  // recorded after the copies on a GPU (on a CPU they are done at once)
};

namespace {

at::Tensor bytes_on(c10::Device device, size_t n, bool pinned = false) {
  return at::empty({static_cast<int64_t>(n)},
                   at::TensorOptions().dtype(at::kByte).device(device).pinned_memory(pinned));
}

}  // namespace

UploadedState upload_state(const HostDecideState& host, c10::Device device) {
  UploadedState d;
  d.rings = at::empty({static_cast<int64_t>(host.rings.size())},
                      at::TensorOptions().dtype(at::kDouble).device(device));
  d.rings.copy_(
      at::from_blob(const_cast<double*>(host.rings.data()), {d.rings.numel()}, at::kDouble));
  const core::DecideState s =
      core::relocated(host.s, host.rings.data(), d.rings.data_ptr<double>());
  d.state = bytes_on(device, sizeof s);
  d.state.copy_(at::from_blob(const_cast<core::DecideState*>(&s),
                              {static_cast<int64_t>(sizeof s)}, at::kByte));
  d.loss_scale = at::from_blob(d.state.data_ptr<uint8_t>() + offsetof(core::DecideState, scale) +
                                   offsetof(core::LossScaleState, scale),
                               {}, at::TensorOptions().dtype(at::kDouble).device(device));
  return d;
}

double await_copies(c10::Event& copied, bool on_gpu, int64_t held, int64_t step,
                    const char* what) {
  if (held != step)
    throw std::logic_error(fmt::format("{}: step {} is not among the last two decided (slot "
                                       "holds {})",
                                       what, step, held));
  if (!on_gpu) return 0;
  const auto start = std::chrono::steady_clock::now();
  copied.synchronize();
  return std::max(
      1e-9, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

DeviceDecision::DeviceDecision(c10::Device device, int world, const SkipDetector& detector,
                               const TensorStart& tensors)
    : device_(device),
      world_(world),
      config_(detector.config()),
      rule_(tensors.rule),
      tensors_(static_cast<int>(tensors.thresholds.size())) {
  UploadedState up = upload_state(detector.state_for(world), device);  // the host's, as it is
  rings_ = std::move(up.rings);
  state_ = std::move(up.state);
  loss_scale_ = std::move(up.loss_scale);
  const bool pinned = device.is_cuda();
  for (auto& slot : slots_) {
    slot = std::make_unique<Slot>(device.type());
    slot->result = bytes_on(device, sizeof(core::DecideResult));
    slot->flags = at::empty({2}, at::TensorOptions().dtype(at::kFloat).device(device));
    slot->result_host = bytes_on(c10::kCPU, sizeof(core::DecideResult), pinned);
    slot->flags_host =
        at::empty({2}, at::TensorOptions().dtype(at::kFloat).pinned_memory(pinned));
    if (tensors_ == 0) continue;
    slot->tensor_flags = at::empty({2 * tensors_}, slot->flags.options());
    slot->tensor_flags_host =
        at::empty({2 * tensors_}, at::TensorOptions().dtype(at::kFloat).pinned_memory(pinned));
  }
  if (tensors_ == 0) return;
  const auto fp64 = at::TensorOptions().dtype(at::kDouble);
  gamma_ = at::from_blob(const_cast<double*>(tensors.thresholds.data()), {tensors_}, fp64)
               .to(device, at::kDouble, /*non_blocking=*/false, /*copy=*/true);
  taken_ = at::full({1}, tensors.taken, at::TensorOptions().dtype(at::kLong)).to(device);
}

DeviceDecision::~DeviceDecision() = default;

void DeviceDecision::decide_tensors(const at::Tensor& table, const at::Tensor& sums, Slot& slot) {
  const auto* state = reinterpret_cast<const core::DecideState*>(state_.data_ptr<uint8_t>());
  const auto* result = reinterpret_cast<const core::DecideResult*>(slot.result.data_ptr<uint8_t>());
  float* factors = slot.tensor_flags.data_ptr<float>();
  if (device_.is_cuda()) {
#ifdef LOCKSTEP_WITH_CUDA
    const auto stream = c10::cuda::getCurrentCUDAStream(device_.index());
    const int err = kernels::launch_decide_tensors(
        table.const_data_ptr<double>(), world_, sums.const_data_ptr<double>(), tensors_,
        const_cast<core::DecideState*>(state), config_, rule_, result,
        taken_.data_ptr<int64_t>(), gamma_.data_ptr<double>(), factors, factors + tensors_,
        stream.stream());
    if (err != 0)
      throw std::runtime_error(fmt::format("the device decision ({}:{}): kernel launch failed "
                                           "with CUDA error {}",
                                           __FILE__, __LINE__, err));
#endif
    return;
  }
  core::decide_tensors(table.const_data_ptr<double>(), world_, sums.const_data_ptr<double>(),
                       tensors_, *state, config_, rule_, *result, *taken_.data_ptr<int64_t>(),
                       gamma_.data_ptr<double>(), factors, factors + tensors_);
}

DeviceDecision::Update DeviceDecision::decide(const at::Tensor& gathered, int64_t step) {
  Slot& slot = *slots_[static_cast<size_t>(step % 2)];
  const at::Tensor whole = gathered.to(device_, at::kDouble).contiguous();
  const int world = static_cast<int>(whole.size(0));
  if (world != world_ || whole.size(1) != core::kStatsDoubles + tensors_)
    throw std::logic_error(fmt::format("device decision: a [{}, {}] table for {} ranks and {} "
                                       "tensors",
                                       world, whole.size(1), world_, tensors_));
  const at::Tensor t =
      tensors_ > 0 ? whole.narrow(1, 0, core::kStatsDoubles).contiguous() : whole;
  auto* state = reinterpret_cast<core::DecideState*>(state_.data_ptr<uint8_t>());
  auto* result = reinterpret_cast<core::DecideResult*>(slot.result.data_ptr<uint8_t>());
  float* flags = slot.flags.data_ptr<float>();
  if (device_.is_cuda()) {
#ifdef LOCKSTEP_WITH_CUDA
    const auto stream = c10::cuda::getCurrentCUDAStream(device_.index());
    const int err = kernels::launch_decide_step(t.const_data_ptr<double>(), world, state, config_,
                                                result, flags, flags + 1, stream.stream());
    if (err != 0)
      throw std::runtime_error(fmt::format("the device decision ({}:{}): kernel launch failed "
                                           "with CUDA error {}",
                                           __FILE__, __LINE__, err));
#endif
  } else {
    core::decide_step(t.const_data_ptr<double>(), world, *state, config_, *result, flags,
                      flags + 1);
  }
  Update u{slot.flags.select(0, 0), slot.flags.select(0, 1), {}, {}};
  if (tensors_ > 0) {
    decide_tensors(t, whole.narrow(1, core::kStatsDoubles, tensors_).contiguous(), slot);
    u.factors = slot.tensor_flags.narrow(0, 0, tensors_);
    u.resets = slot.tensor_flags.narrow(0, tensors_, tensors_);
  }
  // The host's copies, without waiting: it reads them a step later.
  const bool async = device_.is_cuda();
  if (!slot.table_host.defined() || slot.table_host.numel() != whole.numel())
    slot.table_host =
        at::empty(whole.sizes(), at::TensorOptions().dtype(at::kDouble).pinned_memory(async));
  slot.table_host.copy_(whole, async);
  slot.result_host.copy_(slot.result, async);
  slot.flags_host.copy_(slot.flags, async);
  if (tensors_ > 0) slot.tensor_flags_host.copy_(slot.tensor_flags, async);
  if (async) slot.copied.record(c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_));
  slot.step = step;
  return u;
}

DeviceDecision::Readback DeviceDecision::read(int64_t step) {
  Slot& slot = *slots_[static_cast<size_t>(step % 2)];
  Readback late;
  late.waited = await_copies(slot.copied, device_.is_cuda(), slot.step, step, "device decision");
  const int64_t world = slot.table_host.size(0);
  late.table.resize(static_cast<size_t>(world));
  static_assert(sizeof(RankStats) == core::kStatsDoubles * sizeof(double));
  const at::Tensor stats = slot.table_host.narrow(1, 0, core::kStatsDoubles).contiguous();
  std::memcpy(static_cast<void*>(late.table.data()), stats.const_data_ptr<double>(),
              sizeof(RankStats) * late.table.size());
  if (tensors_ > 0) {
    late.tensor_sums = slot.table_host.narrow(1, core::kStatsDoubles, tensors_).clone();
    const float* f = slot.tensor_flags_host.const_data_ptr<float>();
    late.factors.assign(f, f + tensors_);
    late.resets.assign(f + tensors_, f + 2 * tensors_);
  }
  std::memcpy(&late.result, slot.result_host.const_data_ptr<uint8_t>(), sizeof late.result);
  late.found_inf = slot.flags_host.const_data_ptr<float>()[0];
  late.grad_scale = slot.flags_host.const_data_ptr<float>()[1];
  return late;
}

bool device_decides(const Config& c, const UpdatePath& u) {
  switch (c.skip.device_decision) {
    case DeviceDecisionMode::kOff: return false;
    case DeviceDecisionMode::kOn:
      if (!u.takes_found_inf)
        throw ConfigError(
            "invalid value for 'skip.device_decision': \"on\" needs a fused optimizer that "
            "takes found_inf (torch.optim.AdamW(..., fused=True)); set it to \"auto\" or "
            "\"off\"");
      return true;
    case DeviceDecisionMode::kAuto: break;
  }
  // skip.exchange = "record" with the per-tensor policies: the host, which has their record form
  const bool record_on_host = c.skip.exchange == Exchange::kRecord && tensor_policies_on(c.skip);
  return u.on_gpu && u.takes_found_inf && device_decision_blocker(c).empty() &&
         host_decides_because(u).empty() && !record_on_host;
}

std::string host_decides_because(const UpdatePath& u) {
  if (!u.on_gpu) return "";
  return !u.host_exchange.empty() ? u.host_exchange : u.host_read;
}

void expect_same_decision(int64_t step, const Verdict& v, double clip,
                          const core::DecideResult& r, float device_found_inf,
                          float grad_scale) {
  const bool clipped = v.decision == Decision::kClip;
  const core::Outcome host = outcome_of(v.decision);
  const float found_inf = host == core::kTake ? 0.0f : 1.0f;
  // The same bits: the core returns one canonical NaN on every device.
  const bool same_norm = std::memcmp(&r.grad_norm, &v.grad_norm, sizeof(double)) == 0;
  const bool same = r.outcome == host && (r.clipped != 0) == clipped &&
                    device_found_inf == found_inf && same_norm &&
                    (host != core::kTake ||
                     grad_scale == static_cast<float>(v.loss_scale / clip));
  if (same) return;
  throw Error(ExitCode::kTrainingAborted,
              fmt::format("step {}: the device decided {} (grad_norm {}, grad_scale {}) but the "
                          "host {} (grad_norm {}, clip {}); this is a bug in lockstep: please "
                          "report it; skip.device_decision = \"off\" decides on the host only",
                          step, static_cast<int>(r.outcome), r.grad_norm, grad_scale,
                          decision_name(v.decision), v.grad_norm, clip));
}

}  // namespace lockstep
