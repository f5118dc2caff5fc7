#include "decide/device_record.h"

#include <ATen/ops/empty.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>

#include <cstring>
#include <stdexcept>

#include "decide/device_decision.h"
#include "kernels/decide_step.h"

#ifdef LOCKSTEP_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace lockstep {

namespace {

constexpr int kRecordInts = core::kRecordSums + core::kRecordMaxes;  // then the count

#ifdef LOCKSTEP_WITH_CUDA
void launched(int err) {
  if (err != 0)
    throw std::runtime_error(fmt::format("the device decision (record form): kernel launch "
                                         "failed with CUDA error {}",
                                         err));
}
#endif

}  // namespace

// One step on the device (the record, then the count; the result; found_inf, grad_scale; the
// row) and its copies on the host (pinned on a GPU).
struct DeviceRecord::Slot {
  explicit Slot(c10::DeviceType type) : copied(type) {}
  at::Tensor ints, result, flags, row;
  at::Tensor ints_host, result_host, flags_host, row_host;
  int64_t step = -1;
  c10::Event copied;
};

DeviceRecord::DeviceRecord(c10::Device device, const SkipDetector& detector, Comm* comm)
    : device_(device), comm_(comm), world_(comm ? comm->size() : 1), config_(detector.config()) {
  if (!detector.own_only())
    throw std::logic_error("DeviceRecord: the detector keeps every rank's windows");
  UploadedState up = upload_state(detector.host_state(), device);
  rings_ = std::move(up.rings);
  state_ = std::move(up.state);
  loss_scale_ = std::move(up.loss_scale);
  const bool pinned = device.is_cuda();
  const auto on = [&](at::ScalarType t, int64_t n) {
    return at::empty({n}, at::TensorOptions().dtype(t).device(device));
  };
  const auto host = [&](at::ScalarType t, int64_t n) {
    return at::empty({n}, at::TensorOptions().dtype(t).pinned_memory(pinned));
  };
  const auto result_bytes = static_cast<int64_t>(sizeof(core::DecideResult));
  for (auto& slot : slots_) {
    slot = std::make_unique<Slot>(device.type());
    slot->ints = on(at::kLong, kRecordInts + 1);
    slot->result = on(at::kByte, result_bytes);
    slot->flags = on(at::kFloat, 2);
    slot->ints_host = host(at::kLong, kRecordInts + 1);
    slot->result_host = host(at::kByte, result_bytes);
    slot->flags_host = host(at::kFloat, 2);
    slot->row_host = host(at::kDouble, core::kStatsDoubles);
  }
}

DeviceRecord::~DeviceRecord() = default;

void DeviceRecord::all_reduce(at::Tensor t, bool max) const {
  if (!comm_ || comm_->size() == 1) return;
  const c10::Device where = comm_->device();
  at::Tensor x = t.device() == where ? t : t.to(where);
  (max ? comm_->all_reduce_max_async(x) : comm_->all_reduce_sum_async(x))->wait();
  if (!x.is_same(t)) t.copy_(x);
}

DeviceRecord::Update DeviceRecord::decide(const at::Tensor& in, int64_t step) {
  Slot& slot = *slots_[static_cast<size_t>(step % 2)];
  slot.row = in.to(device_, at::kDouble).contiguous();
  if (slot.row.numel() != core::kStatsDoubles)
    throw std::logic_error(fmt::format("device record: a row of {} numbers", slot.row.numel()));
  const double* row = slot.row.const_data_ptr<double>();
  auto* state = reinterpret_cast<core::DecideState*>(state_.data_ptr<uint8_t>());
  auto* all = reinterpret_cast<core::StepRecord*>(slot.ints.data_ptr<int64_t>());
  int64_t* below = slot.ints.data_ptr<int64_t>() + kRecordInts;
  auto* result = reinterpret_cast<core::DecideResult*>(slot.result.data_ptr<uint8_t>());
  float* flags = slot.flags.data_ptr<float>();
#ifdef LOCKSTEP_WITH_CUDA
  void* stream = nullptr;
  if (device_.is_cuda()) stream = c10::cuda::getCurrentCUDAStream(device_.index()).stream();
#endif
  const bool cuda = device_.is_cuda();
  if (cuda) {
#ifdef LOCKSTEP_WITH_CUDA
    launched(kernels::launch_record_contribute(row, state, config_, all, stream));
#endif
  } else {
    core::record_contribute(row, *state, config_, *all);
  }
  all_reduce(slot.ints.narrow(0, 0, core::kRecordSums), false);
  all_reduce(slot.ints.narrow(0, core::kRecordSums, core::kRecordMaxes), true);
  if (cuda) {
#ifdef LOCKSTEP_WITH_CUDA
    launched(kernels::launch_record_below(row, all, below, stream));
#endif
  } else {
    *below = core::record_below(row, *all);
  }
  all_reduce(slot.ints.narrow(0, kRecordInts, 1), false);
  if (cuda) {
#ifdef LOCKSTEP_WITH_CUDA
    launched(kernels::launch_decide_record(all, world_, below, row, state, config_, result, flags,
                                           flags + 1, stream));
#endif
  } else {
    core::decide_record_step(*all, world_, *below, row, *state, config_, *result, flags,
                             flags + 1);
  }
  // The host's copies, without waiting: it reads them a step later.
  slot.ints_host.copy_(slot.ints, cuda);
  slot.result_host.copy_(slot.result, cuda);
  slot.flags_host.copy_(slot.flags, cuda);
  slot.row_host.copy_(slot.row, cuda);
  if (cuda) slot.copied.record(c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_));
  slot.step = step;
  return {slot.flags.select(0, 0), slot.flags.select(0, 1)};
}

DeviceRecord::Readback DeviceRecord::read(int64_t step) {
  Slot& slot = *slots_[static_cast<size_t>(step % 2)];
  Readback late;
  late.waited = await_copies(slot.copied, device_.is_cuda(), slot.step, step, "device record");
  std::memcpy(static_cast<void*>(&late.mine), slot.row_host.const_data_ptr<double>(),
              sizeof late.mine);
  std::memcpy(&late.record, slot.ints_host.const_data_ptr<int64_t>(), sizeof late.record);
  late.below = slot.ints_host.const_data_ptr<int64_t>()[kRecordInts];
  std::memcpy(&late.result, slot.result_host.const_data_ptr<uint8_t>(), sizeof late.result);
  late.found_inf = slot.flags_host.const_data_ptr<float>()[0];
  late.grad_scale = slot.flags_host.const_data_ptr<float>()[1];
  return late;
}

}  // namespace lockstep
