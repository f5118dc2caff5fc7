// The step's decision taken where the gradients are (skip.device_decision): the exchanged
// table stays on the device, core::decide_step (one thread, kernels/decide_step.cu) decides there and
// writes found_inf and grad_scale for the fused AdamW, so a clean step never waits for the
// host. The host copies the table and the result into pinned memory as the step goes on and
// reads them a step later, to take the same decision on its own (SkipDetector, over the same
// core: the diagnostics, the counters, the progress line) and to check that the two agree bit
// for bit. An abort is sticky on the device: every update after it is blocked until the host,
// a step later, stops. On a CPU the same path runs in host memory (the tests use it).
//
// The device form covers every decision taken from the exchanged table alone: each
// skip.on_global_spike (the scope from every rank's own windows, kept on the device too), and
// the per-tensor policies (AdaGC's clip, SPAM's reset: their sums ride in the same table, a
// second kernel decides each tensor, decide/tensor_policies.h), with skip.scope = "step", no
// replay or probe, lr_scheduler.on_skip = "advance" (the host
// sets the next step's lr before it reads this one's verdict); device_decision_blocker
// (config.h) names what keeps a config out of it, decides_on_host_because what keeps "auto" on
// the host. With fp16 loss scaling the forward multiplies by the device's scale (loss_scale()).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "decide/detector.h"
#include "decide/core/step.h"
#include "decide/core/tensors.h"
#include "kernels/decide_step.h"
#include "lockstep/config.h"

namespace lockstep {

// What a run's step offers a device decision; lockstep's trainer (update_path.cpp) and the
// PyTorch guard (python/lockstep/torch.py) each describe theirs and share the rule below.
struct UpdatePath {
  bool on_gpu = false;         // the gradients and the exchanged table live on a GPU
  std::string host_exchange;   // why the table reaches the host anyway (Gloo, MPI), or ""
  bool takes_found_inf = true; // the update skips and clips from found_inf and grad_scale
  std::string host_read;       // why the update reads them on the host (a for-loop AdamW), or ""
};
// skip.device_decision for that path: "off": the host; "on": the device (the config reader
// refused configs with no device form; ConfigError when the update cannot take found_inf);
// "auto": the device on a GPU, for a config with a device form, when nothing reads on the host.
bool device_decides(const Config& c, const UpdatePath& u);
// Why "auto" keeps a config that has a device form on the host ("" when it does not).
std::string host_decides_because(const UpdatePath& u);

// The trainer's path (update_path.cpp: its backend, its AdamW), and the rule over it.
UpdatePath update_path(const Config& c, c10::Device device, int local_ranks = 1);
bool decides_on_device(const Config& c, c10::Device device, int local_ranks = 1);
std::string decides_on_host_because(const Config& c, c10::Device device, int local_ranks = 1);

// The per-tensor policies' state the device starts from (TensorPolicies::device_start; empty
// thresholds: neither policy is on).
struct TensorStart {
  core::TensorRule rule;
  int64_t taken = 0;
  std::vector<double> thresholds;
};

// A host state on the device: its rings in one copy, the struct pointing at them, and a 0-dim
// fp64 view of its loss scale (what the next step's loss is multiplied by).
struct UploadedState {
  at::Tensor rings, state, loss_scale;
};
UploadedState upload_state(const HostDecideState& host, c10::Device device);
// A slot's copies to the host, read a step after they were started: refuses a slot that holds
// another step than `step` (`what` names the decision), then waits for the copies on a GPU.
// Returns the seconds waited (0 on a CPU, at least 1 ns on a GPU).
double await_copies(c10::Event& copied, bool on_gpu, int64_t held, int64_t step,
                    const char* what);

class DeviceDecision {
 public:
  // Starts from the host's state (after a resume: the checkpoint's windows, guards, loss scale,
  // per-tensor thresholds).
  DeviceDecision(c10::Device device, int world, const SkipDetector& detector,
                 const TensorStart& tensors = {});
  ~DeviceDecision();
  DeviceDecision(const DeviceDecision&) = delete;
  DeviceDecision& operator=(const DeviceDecision&) = delete;

  // The update's inputs, on the device: found_inf (1: skip or abort) and grad_scale; with the
  // per-tensor policies each tensor's factor (1: none) and reset (1: zero its moments), fp32.
  struct Update {
    at::Tensor found_inf, grad_scale, factors, resets;
  };
  // Decides the step whose table this is (on the device; [W, 9], and each rank's per-tensor
  // sums after its 9 with the per-tensor policies) into slot `step % 2`, and starts copying the
  // table and the results to the host.
  Update decide(const at::Tensor& table, int64_t step);

  // What the device decided at `step` (one of the last two), on the host: waits for the copy,
  // which by a step later has landed.
  struct Readback {
    std::vector<RankStats> table;
    core::DecideResult result{};
    float found_inf = 0, grad_scale = 0;
    at::Tensor tensor_sums;                  // [W, tensors] fp64 (per-tensor policies)
    std::vector<float> factors, resets;      // what the device decided per tensor
    double waited = 0;  // seconds the host blocked on the copy (0: nothing to wait for, a CPU)
  };
  Readback read(int64_t step);

  // The loss scale the next step multiplies its loss by: a 0-dim fp64 view of the device's
  // state (the host's is a step behind).
  const at::Tensor& loss_scale() const { return loss_scale_; }

 private:
  struct Slot;
  void decide_tensors(const at::Tensor& table, const at::Tensor& sums, Slot& slot);

  c10::Device device_;
  int world_;
  core::DecideConfig config_{};
  at::Tensor rings_, state_;  // device: the windows and the DecideState pointing into them
  core::TensorRule rule_{};
  int tensors_ = 0;          // per-tensor policies: the tensors (0: off)
  at::Tensor gamma_, taken_;  // device: their thresholds (fp64) and taken steps (int64)
  at::Tensor loss_scale_;     // a view of state_'s scale
  std::array<std::unique_ptr<Slot>, 2> slots_;
};

// Throws (exit code 4) when the host's decision of `step` (its verdict and clip) differs from
// the device's (its result and flags, the table's form or the record's): a bug, named with both
// numbers.
void expect_same_decision(int64_t step, const Verdict& v, double clip,
                          const core::DecideResult& r, float found_inf, float grad_scale);

}  // namespace lockstep
