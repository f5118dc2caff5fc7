// The record form decided on the device (skip.device_decision with skip.exchange): this rank's
// own windows and the global state live on the device; three one-thread kernels
// (kernels/decide_step.cu) around the collectives, all on the step's stream, with nothing read
// on the host before the update:
//
//   record_contribute   this rank's row against its own windows: its part of the record
//   all-reduce          the sums added, the largest numbers taken (two collectives in flight)
//   record_below        this rank's part of the cross-rank count (always counted here)
//   all-reduce          the count added
//   decide_record_step  found_inf and grad_scale for the fused AdamW, the state, its own windows
//
// No kernel and no message grows with the world (1,192 + 8 bytes a step). The host copies the
// record, the count, its row and the result into pinned memory as the step goes on and reads
// them a step later, to take the same decision from the same record on its own and check the
// two agree (StepJudge::read), as DeviceDecision does for the table. On a CPU the same path runs
// in host memory (the tests use it). The per-tensor policies read every rank's sums: with them
// the device decides from the table (exchanges_record).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <array>
#include <cstdint>
#include <memory>

#include "comm/comm.h"
#include "decide/core/record.h"
#include "decide/detector.h"

namespace lockstep {

class DeviceRecord {
 public:
  // Starts from the host's state (own windows: `detector` is in the record form); `comm`: the
  // ranks' collectives (null: one rank).
  DeviceRecord(c10::Device device, const SkipDetector& detector, Comm* comm);
  ~DeviceRecord();
  DeviceRecord(const DeviceRecord&) = delete;
  DeviceRecord& operator=(const DeviceRecord&) = delete;

  struct Update {
    at::Tensor found_inf, grad_scale;  // on the device, fp32
  };
  // Decides the step whose row (this rank's [9] fp64 stats) this is, into slot `step % 2`.
  Update decide(const at::Tensor& row, int64_t step);

  // What the device decided at `step` (one of the last two), on the host.
  struct Readback {
    RankStats mine{};
    core::StepRecord record{};  // every rank's, combined
    int64_t below = 0;          // the cross-rank count
    core::DecideResult result{};
    float found_inf = 0, grad_scale = 0;
    double waited = 0;  // seconds the host blocked on the copy (0 on a CPU)
  };
  Readback read(int64_t step);

  // The loss scale the next step multiplies its loss by (a 0-dim fp64 view of the state).
  const at::Tensor& loss_scale() const { return loss_scale_; }

 private:
  struct Slot;
  // `t` reduced over the ranks in place: `max` takes the largest, else it adds (a copy there
  // and back when the collectives run elsewhere, as Gloo's on a GPU run).
  void all_reduce(at::Tensor t, bool max) const;

  c10::Device device_;
  Comm* comm_;
  int world_;
  core::DecideConfig config_{};
  at::Tensor rings_, state_, loss_scale_;
  std::array<std::unique_ptr<Slot>, 2> slots_;
};

}  // namespace lockstep
