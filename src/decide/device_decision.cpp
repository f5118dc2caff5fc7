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
          k.fraction_window};
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

// A host ring holding `values` oldest first (its memory: `at`, capacity `capacity`).
kernels::Ring ring_of(double* at, int64_t capacity, const std::vector<double>& values) {
  kernels::Ring r{at, capacity, 0, 0};
  for (double v : values) kernels::ring_push(r, v);
  return r;
}


at::Tensor bytes_on(c10::Device device, size_t n, bool pinned = false) {
  return at::empty({static_cast<int64_t>(n)},
                   at::TensorOptions().dtype(at::kByte).device(device).pinned_memory(pinned));
}

}  // namespace

DeviceDecision::DeviceDecision(const Config& c, c10::Device device, const SkipDetector& detector,
                               const LossScaler& scaler, const TrainState& st)
    : device_(device), config_(decide_config(c.skip, c.training)) {
  const int64_t window = c.skip.window, fraction = c.skip.fraction_window;
  // The host's state laid out as the device's: rings first, then the struct pointing into them.
  std::vector<double> rings(kernels::decide_state_doubles(window, fraction), 0.0);
  rings_ = at::empty({static_cast<int64_t>(rings.size())},
                     at::TensorOptions().dtype(at::kDouble).device(device));
  double* base = rings_.data_ptr<double>();  // device addresses: written into the struct only
  const auto host_ring = [&](int64_t offset, int64_t capacity, const std::vector<double>& v) {
    kernels::Ring r = ring_of(rings.data() + offset, capacity, v);
    r.values = base + offset;
    return r;
  };
  const auto values = [](const Window& w) {
    return std::vector<double>(w.values().begin(), w.values().end());
  };
  std::vector<double> recent;
  for (bool skipped : detector.recent()) recent.push_back(skipped ? 1.0 : 0.0);
  kernels::DecideState s{};
  s.grad_norms = host_ring(0, window, values(detector.grad_norms()));
  s.losses = host_ring(window, window, values(detector.losses()));
  s.recent = host_ring(2 * window, fraction, recent);
  for (double r : recent) s.recent_skips += static_cast<int64_t>(r);
  s.scale = scaler.core_state();
  s.consecutive_skips = detector.consecutive_skips();
  s.optimizer_steps = st.optimizer_steps;
  s.skipped_steps = st.skipped_steps;
  s.overflow_skips = st.overflow_skips;
  rings_.copy_(at::from_blob(rings.data(), {rings_.numel()}, at::kDouble));
  state_ = bytes_on(device, sizeof s);
  state_.copy_(at::from_blob(&s, {static_cast<int64_t>(sizeof s)}, at::kByte));
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
  const int32_t host = v.decision == Decision::kStep   ? kernels::kTake
                       : v.decision == Decision::kSkip ? kernels::kSkipStep
                                                       : kernels::kAbortRun;
  const float found_inf = host == kernels::kTake ? 0.0f : 1.0f;
  // The same bits, or NaN on both sides (a GPU may give another NaN's bits than the CPU).
  const bool same_norm = std::memcmp(&r.grad_norm, &v.grad_norm, sizeof(double)) == 0 ||
                         (std::isnan(r.grad_norm) && std::isnan(v.grad_norm));
  const bool same = r.outcome == host && device.found_inf == found_inf && same_norm &&
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
