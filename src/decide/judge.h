// The decided step's one owner, for lockstep's trainer (train.cpp) and the PyTorch guard
// (python/csrc/ext.cpp) alike: the detector (the host decision and its windows), the per-tensor
// policies, the optional device decision, the explanation and the event file.
//
//   decide(table)              the host decides (lag 0), or
//   decide_on_device(table, n) the device decides (found_inf, grad_scale) and
//   read(n)                    a step later the host decides the same from the copied table and
//                              checks the device agreed (the lag: one of the last two steps);
//   explain(...)               an anomalous step's event, written to the rank's event file;
//   record(...)                the step's effect on the counters and the windows.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "decide/detector.h"
#include "decide/device_decision.h"
#include "decide/device_record.h"
#include "decide/tensor_policies.h"
#include "diag/event.h"
#include "diag/explain.h"
#include "lockstep/config.h"
#include "run_state.h"

namespace lockstep {

// Whether a decided step may be the model's own fault (a nonfinite gradient or loss): then every
// rank counts the nonfinite values of the parameters it holds (nonfinite_tensors, check/) and
// the counts are exchanged, so all ranks call blame_model with the same `counts`.
bool model_suspect(const Verdict& v);
// `counts`: every rank's count of nonfinite parameter values, in rank order (`mine`: this rank's,
// by tensor). When any is above 0 the verdict becomes an abort of global scope and cause
// "model", blaming no rank and no sample (nothing is quarantined), its guard naming those ranks
// and this rank's tensors. The trainer (outcome.cpp) and the PyTorch guard call it alike.
void blame_model(Verdict& v, const std::vector<double>& counts,
                 const std::vector<std::pair<std::string, int64_t>>& mine);

class StepJudge {
 public:
  struct Where {
    int rank = 0, world = 1;
    std::string host, device;
    std::string loop = "lockstep";  // whose loop the events speak to (explain.h)
    bool record_form = false;       // skip.exchange: the detector holds this rank's windows only
    // each rank's place in the device mesh ("pp 1, dp 0, tp 1"); empty: no mesh (events name
    // ranks by number only)
    std::vector<std::string> places;
  };
  // `skip`: the config's, with the trainer's token guard folded in (job.cpp); `grads` names the
  // checks' tensors in order (events), `tensors` the per-tensor policies' (check [B]'s);
  // `comm`: their gather (null: the caller exchanges the sums itself, as the guard does).
  StepJudge(const Config& c, const SkipConfig& skip, std::vector<NamedTensor> grads,
            std::vector<std::string> tensors, Comm* comm, Where where);

  SkipDetector& detector() { return detector_; }
  const SkipDetector& detector() const { return detector_; }
  TensorPolicies& tensors() { return tensors_; }

  Verdict decide(const std::vector<RankStats>& table, const Triage& triage = {}) const {
    return detector_.decide(table, triage);
  }

  // The device decision, from the host's state as it is now (after a resume: the checkpoint's):
  // the record form's (device_record.h; `comm` its collectives) when the detector keeps its
  // own windows only, else the table's (device_decision.h).
  void start_device(c10::Device device, Comm* comm = nullptr);
  bool on_device() const { return device_ != nullptr || record_device_ != nullptr; }
  // The device's loss scale for the next step's loss.
  const at::Tensor& device_loss_scale() const {
    return record_device_ ? record_device_->loss_scale() : device_->loss_scale();
  }
  // `t`: the gathered table, or in the record form this rank's row.
  DeviceDecision::Update decide_on_device(const at::Tensor& t, int64_t step);
  // The host's own verdict of a device-decided step, checked against the device's. The record
  // form names nobody yet: its `table` is empty, and `mine` and `own` (this rank's row and
  // finding) go with the rows gathered for the names (decide/record.h: name_by_record).
  struct Checked {
    Verdict verdict;
    std::vector<RankStats> table;
    double waited = 0;           // seconds the host blocked on the device's copy
    double seconds = 0;          // this rank's compute; did every rank measure its?
    bool all_measured = false;
    std::optional<RankStats> mine;
    core::RankFinding own{};
  };
  Checked read(int64_t step);

  // The event of an anomalous step (the counters as it leaves them: `before` counted with it),
  // written to the event file once one is open; a failed write is reported once through `warn`
  // and training goes on.
  Event explain(const RunCounters& before, const RankStep& mine, const Verdict& v,
                const std::vector<RankStats>& table, const SampleTable& samples, double lr,
                int64_t tokens, int64_t data_position);
  // `now`: create the file at once (lockstep's trainer: an unwritable run folder stops the
  // start); else with the first event (the guard).
  void open_events(const std::string& path, std::function<void(const std::string&)> warn,
                   bool now = false);
  // Any event record (a desync's too), with the same warning on failure.
  void write_event(const nlohmann::json& record);
  // The decided step's effect: the windows, guards and loss scale (the per-tensor thresholds
  // moved when the tensors were decided) and the counters.
  void record(RunCounters& counters, const Verdict& v, int64_t tokens, int64_t data_position);

  // The detector's state with the per-tensor thresholds (checkpoints store it as "detector"),
  // and the loss scale's; load both back (a state without "tensors": a fresh warm-up).
  nlohmann::json state() const;
  nlohmann::json loss_scale_state() const { return detector_.loss_scale_state(); }
  void load_state(const nlohmann::json& detector, const nlohmann::json& loss_scale);

 private:
  Checked read_record(int64_t step);

  SkipDetector detector_;
  TensorPolicies tensors_;
  Explainer explainer_;
  int world_;
  std::unique_ptr<DeviceDecision> device_;
  std::unique_ptr<DeviceRecord> record_device_;
  int rank_;
  std::unique_ptr<JsonlWriter> events_;
  std::string events_path_;
  std::function<void(const std::string&)> warn_;
  bool warned_ = false;
};

}  // namespace lockstep
