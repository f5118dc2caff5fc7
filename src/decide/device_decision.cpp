#include "decide/device_decision.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <stdexcept>

#include "decide/exchange.h"
#include "lockstep/error.h"

#ifdef LOCKSTEP_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace lockstep {

kernels::DecideConfig decide_config(const SkipConfig& k, const TrainingConfig& t) {
  return {{k.enabled, k.max_grad_norm, k.grad_norm_zscore, k.loss_zscore},
          k.min_history,
          t.max_norm,
          LossScaler(t).rule(),
          t.loss_scale_max_overflows,
          t.loss_scale_min,
          k.max_consecutive,
          k.max_fraction,
          k.fraction_window,
          k.on_global_spike == OnGlobalSpike::kClip   ? kernels::kSpikeClip
          : k.on_global_spike == OnGlobalSpike::kSkip ? kernels::kSpikeSkip
                                                      : kernels::kSpikeAbort};
}

bool decides_on_device(const Config& c, c10::Device device) {
  switch (c.skip.device_decision) {
    case DeviceDecisionMode::kOn: return true;
    case DeviceDecisionMode::kOff: return false;
    case DeviceDecisionMode::kAuto: break;
  }
  return device.is_cuda() && device_decision_blocker(c).empty();
}

// One step's result on the device and its copy on the host (pinned on a GPU).
struct DeviceDecision::Slot {
  explicit Slot(c10::DeviceType type) : copied(type) {}
  at::Tensor result, flags;             // device: DecideResult bytes; found_inf, grad_scale
  at::Tensor table_host, result_host, flags_host;
  int64_t step = -1;
  c10::Event copied;  // recorded after the copies on a GPU (on a CPU they are done at once)
};

namespace {

at::Tensor bytes_on(c10::Device device, size_t n, bool pinned = false) {
  return at::empty({static_cast<int64_t>(n)},
                   at::TensorOptions().dtype(at::kByte).device(device).pinned_memory(pinned));
}

}  // namespace

namespace {

// The host's state laid out as the device's, in `rings` (host memory) with the addresses the
// device will read it at (`base`): the windows, each rank's own (empty when the host holds none
// for this world size), the recent decisions, the guards and counters.
kernels::DecideState host_state(const Config& c, int world, const SkipDetector& detector,
                                const LossScaler& scaler, const TrainState& st,
                                std::vector<double>& rings, double* base) {
  const int64_t window = c.skip.window, fraction = c.skip.fraction_window;
  rings.assign(kernels::decide_state_doubles(window, fraction, world), 0.0);
  kernels::DecideState host = kernels::fresh_decide_state(rings.data(), window, fraction, world,
                                                          scaler.scale());
  const auto fill = [](kernels::Ring& r, const std::deque<double>& values) {
    for (double v : values) kernels::ring_push(r, v);
  };
  fill(host.grad_norms, detector.grad_norms().values());
  fill(host.losses, detector.losses().values());
  for (bool skipped : detector.recent()) {
    kernels::ring_push(host.recent, skipped ? 1.0 : 0.0);
    host.recent_skips += skipped ? 1 : 0;
  }
  const auto& rank_gn = detector.rank_grad_norms();
  const auto& rank_ls = detector.rank_losses();
  for (int r = 0; r < world && static_cast<int>(rank_ls.size()) == world; ++r) {
    for (double v : rank_gn[r].values()) kernels::rank_ring_push(host.ranks, r, 0, v);
    for (double v : rank_ls[r].values()) kernels::rank_ring_push(host.ranks, r, 1, v);
  }
  // The same state pointing at the device's copy of `rings`.
  kernels::DecideState s = kernels::fresh_decide_state(base, window, fraction, world, 1.0);
  const auto moved = [](kernels::Ring to, const kernels::Ring& from) {
    to.head = from.head;
    to.size = from.size;
    return to;
  };
  s.grad_norms = moved(s.grad_norms, host.grad_norms);
  s.losses = moved(s.losses, host.losses);
  s.recent = moved(s.recent, host.recent);
  s.recent_skips = host.recent_skips;
  s.scale = scaler.core_state();
  s.consecutive_skips = detector.consecutive_skips();
  s.optimizer_steps = st.optimizer_steps;
  s.skipped_steps = st.skipped_steps;
  s.overflow_skips = st.overflow_skips;
  s.clipped_steps = st.clipped_steps;
  return s;
}

}  // namespace

DeviceDecision::DeviceDecision(const Config& c, c10::Device device, int world,
                               const SkipDetector& detector, const LossScaler& scaler,
                               const TrainState& st)
    : device_(device), world_(world), config_(decide_config(c.skip, c.training)) {
  std::vector<double> rings;
  rings_ = at::empty({kernels::decide_state_doubles(c.skip.window, c.skip.fraction_window, world)},
                     at::TensorOptions().dtype(at::kDouble).device(device));
  // Device addresses: written into the struct only.
  const kernels::DecideState s =
      host_state(c, world, detector, scaler, st, rings, rings_.data_ptr<double>());
  rings_.copy_(at::from_blob(rings.data(), {rings_.numel()}, at::kDouble));
  state_ = bytes_on(device, sizeof s);
  state_.copy_(at::from_blob(const_cast<kernels::DecideState*>(&s),
                             {static_cast<int64_t>(sizeof s)}, at::kByte));
  loss_scale_ = at::from_blob(state_.data_ptr<uint8_t>() + offsetof(kernels::DecideState, scale) +
                                  offsetof(kernels::LossScaleState, scale),
                              {}, at::TensorOptions().dtype(at::kDouble).device(device));
  const bool pinned = device.is_cuda();
  for (auto& slot : slots_) {
    slot = std::make_unique<Slot>(device.type());
    slot->result = bytes_on(device, sizeof(kernels::DecideResult));
    slot->flags = at::empty({2}, at::TensorOptions().dtype(at::kFloat).device(device));
    slot->result_host = bytes_on(c10::kCPU, sizeof(kernels::DecideResult), pinned);
    slot->flags_host =
        at::empty({2}, at::TensorOptions().dtype(at::kFloat).pinned_memory(pinned));
  }
}

DeviceDecision::~DeviceDecision() = default;

DeviceDecision::Update DeviceDecision::decide(const at::Tensor& table, int64_t step) {
  Slot& slot = *slots_[static_cast<size_t>(step % 2)];
  const at::Tensor t = table.to(device_, at::kDouble).contiguous();
  const int world = static_cast<int>(t.size(0));
  if (world != world_)
    throw std::logic_error(fmt::format("device decision: a table of {} ranks for a state of {}",
                                       world, world_));
  auto* state = reinterpret_cast<kernels::DecideState*>(state_.data_ptr<uint8_t>());
  auto* result = reinterpret_cast<kernels::DecideResult*>(slot.result.data_ptr<uint8_t>());
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
    kernels::decide_step(t.const_data_ptr<double>(), world, *state, config_, *result, flags,
                         flags + 1);
  }
  // The host's copies, without waiting: it reads them a step later.
  const bool async = device_.is_cuda();
  if (!slot.table_host.defined() || slot.table_host.numel() != t.numel())
    slot.table_host =
        at::empty(t.sizes(), at::TensorOptions().dtype(at::kDouble).pinned_memory(async));
  slot.table_host.copy_(t, async);
  slot.result_host.copy_(slot.result, async);
  slot.flags_host.copy_(slot.flags, async);
  if (async) slot.copied.record(c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_));
  slot.step = step;
  return {slot.flags.select(0, 0), slot.flags.select(0, 1)};
}

DeviceDecision::Late DeviceDecision::read(int64_t step) {
  Slot& slot = *slots_[static_cast<size_t>(step % 2)];
  if (slot.step != step)
    throw std::logic_error(fmt::format("device decision: step {} is not among the last two "
                                       "decided (slot holds {})",
                                       step, slot.step));
  if (device_.is_cuda()) slot.copied.synchronize();
  Late late;
  const int64_t world = slot.table_host.size(0);
  late.table.resize(static_cast<size_t>(world));
  static_assert(sizeof(RankStats) == kernels::kStatsDoubles * sizeof(double));
  std::memcpy(static_cast<void*>(late.table.data()), slot.table_host.const_data_ptr<double>(),
              sizeof(RankStats) * late.table.size());
  std::memcpy(&late.result, slot.result_host.const_data_ptr<uint8_t>(), sizeof late.result);
  late.found_inf = slot.flags_host.const_data_ptr<float>()[0];
  late.grad_scale = slot.flags_host.const_data_ptr<float>()[1];
  return late;
}

void expect_same_decision(int64_t step, const Verdict& v, double clip,
                          const DeviceDecision::Late& device) {
  const kernels::DecideResult& r = device.result;
  const bool clipped = v.decision == Decision::kClip;
  const int32_t host = v.decision == Decision::kStep || clipped ? kernels::kTake
                       : v.decision == Decision::kSkip          ? kernels::kSkipStep
                                                                : kernels::kAbortRun;
  const float found_inf = host == kernels::kTake ? 0.0f : 1.0f;
  // The same bits, or NaN on both sides (a GPU may give another NaN's bits than the CPU).
  const bool same_norm = std::memcmp(&r.grad_norm, &v.grad_norm, sizeof(double)) == 0 ||
                         (std::isnan(r.grad_norm) && std::isnan(v.grad_norm));
  const bool same = r.outcome == host && (r.clipped != 0) == clipped &&
                    device.found_inf == found_inf && same_norm &&
                    (host != kernels::kTake ||
                     device.grad_scale == static_cast<float>(v.loss_scale / clip));
  if (same) return;
  throw Error(ExitCode::kTrainingAborted,
              fmt::format("step {}: the device decided {} (grad_norm {}, grad_scale {}) but the "
                          "host {} (grad_norm {}, clip {}); this is a bug in lockstep: please "
                          "report it; skip.device_decision = \"off\" decides on the host only",
                          step, r.outcome, r.grad_norm, device.grad_scale,
                          decision_name(v.decision), v.grad_norm, clip));
}

}  // namespace lockstep
