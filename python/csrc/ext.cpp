// lockstep._C: the harness's own check, decision, counters and events, bound for PyTorch trainers
// (python/lockstep/torch.py). Nothing here decides or checks anything itself: GradCheck
// (src/check), SkipDetector, TensorPolicies and DeviceDecision (src/decide, over
// kernels/decision.h), count()
// (src/run_state), Explainer and the event schema (src/diag) and the config reader
// (src/config.cpp) are the files the harness is built from. This file converts types.
#include <torch/extension.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "check/gradcheck.h"
#include "decide/detector.h"
#include "decide/device_decision.h"
#include "decide/tensor_policies.h"
#include "diag/event.h"
#include "diag/explain.h"
#include "lockstep/config.h"
#include "lockstep/error.h"
#include "optim/tensor_values.h"
#include "run_state.h"

namespace py = pybind11;

namespace lockstep {
namespace {

std::vector<NamedTensor> named(const std::vector<std::string>& names,
                               const std::vector<at::Tensor>& tensors) {
  if (names.size() != tensors.size())
    throw std::invalid_argument(fmt::format("{} names for {} tensors", names.size(),
                                            tensors.size()));
  std::vector<NamedTensor> out;
  for (size_t i = 0; i < names.size(); ++i) out.push_back({names[i], tensors[i]});
  return out;
}

// Every shape that comes from Python is checked before a pointer reads it (a ValueError naming
// what was expected): a table of `world` rows of `columns` values.
void expect_table(const at::Tensor& t, const char* what, int64_t world, int64_t columns) {
  if (t.dim() != 2 || t.size(0) != world || t.size(1) != columns)
    throw std::invalid_argument(fmt::format("{}: shape [{}]; expected [{}, {}] (one row per rank)",
                                            what, fmt::join(t.sizes(), ", "), world, columns));
}

// One check's buffer (the header, then a pair per tensor) for `tensors` tensors.
void expect_stats(const std::optional<at::Tensor>& s, const char* what, size_t tensors) {
  const int64_t want = kernels::kStatsHeader + 2 * static_cast<int64_t>(tensors);
  if (s && (s->dim() != 1 || s->numel() != want))
    throw std::invalid_argument(fmt::format("{}: {} values; expected {} (the header and 2 per "
                                            "parameter, in the guard's parameter order)",
                                            what, s->numel(), want));
}

// [W, 9] fp64 (any device) as the rows the host decision reads.
std::vector<RankStats> rows_of(const at::Tensor& table, int64_t world) {
  expect_table(table, "the stats table", world, kRankStatsDoubles);
  const at::Tensor t = table.to(at::kCPU, at::kDouble).contiguous();
  std::vector<RankStats> out(static_cast<size_t>(t.size(0)));
  std::memcpy(static_cast<void*>(out.data()), t.const_data_ptr<double>(),
              sizeof(RankStats) * out.size());
  return out;
}

at::Tensor table_of(const std::vector<RankStats>& rows) {
  at::Tensor t = at::empty({static_cast<int64_t>(rows.size()), kRankStatsDoubles}, at::kDouble);
  std::memcpy(t.data_ptr<double>(), rows.data(), sizeof(RankStats) * rows.size());
  return t;
}

// This rank's side of a decided step, as the trainer's RankStep holds it.
struct LocalStep {
  double loss = 0;
  std::optional<at::Tensor> local_stats, shard_stats;  // the checks' buffers (any device)
  std::vector<int64_t> sample_ids;
  std::vector<double> sample_losses;
};

// The guard's core: the config read by lockstep's reader, the host decision (always: it names
// what the device decided and keeps the checkpointed state), the device decision (fused
// Adam/AdamW: found_inf and grad_scale), the run's counters and the event writer.
class Core {
 public:
  Core(const std::string& toml_text, const std::string& origin,
       const std::vector<Override>& overrides, int rank, int world,
       std::vector<std::string> names, const std::string& run_dir, const std::string& host,
       const std::string& device)
      : config_(load_config(toml_text, origin, overrides)),
        rank_(rank),
        world_(world),
        detector_(config_.skip, config_.training, world),
        tensors_(config_.skip, names, nullptr),
        explainer_(config_.skip, config_.diagnostics.top_params, rank, unnamed(std::move(names)),
                   host, device, "pytorch"),
        run_dir_(run_dir) {
    counters_.world_size = world;
  }

  std::string config_json() const { return to_json(config_); }

  // The host decision of a step from the all-gathered table ([W, 9]).
  Verdict decide(const at::Tensor& table) const {
    return detector_.decide(rows_of(table, world_));
  }

  // The device decision of `step` (its own state, uploaded from the host's at the first call):
  // found_inf and grad_scale on the table's device, for the fused optimizer; with the
  // per-tensor policies (the table's rows then end with each rank's per-tensor sums) each
  // tensor's factor and reset flag there too (else None).
  py::tuple decide_on_device(const at::Tensor& table, int64_t step) {
    expect_table(table, "the stats table", world_,
                 kRankStatsDoubles + (tensors_.active() ? n_tensors() : 0));
    if (!device_)
      device_ = std::make_unique<DeviceDecision>(table.device(), world_, detector_,
                                                 tensors_.device_start());
    const DeviceDecision::Update u = device_->decide(table, step);
    if (!u.factors.defined()) return py::make_tuple(u.found_inf, u.grad_scale, py::none(), py::none());
    return py::make_tuple(u.found_inf, u.grad_scale, u.factors, u.resets);
  }

  // What the device decided at `step` (one of the last two), decided again on the host from
  // the same table (the per-tensor part too); they must agree bit for bit (else an error
  // naming both).
  std::pair<Verdict, at::Tensor> read_device(int64_t step) {
    if (!device_) throw std::invalid_argument("read_device: nothing was decided on the device");
    const DeviceDecision::Late late = device_->read(step);
    Verdict v = detector_.decide(late.table);
    expect_same_decision(step, v, v.clip, late);
    tensors_.mirror(step, late, v);
    return {v, table_of(late.table)};
  }

  // The decided step's effect: the counters, the event of an anomalous step (written to
  // run_dir/diagnostics/rank<R>.jsonl), the windows. Returns the step's one-line message
  // ("" for a clean step).
  std::string finish(const Verdict& v, const at::Tensor& table, const LocalStep& mine,
                     SampleTable samples, double lr, int64_t tokens) {
    if (samples.ids.size() != static_cast<size_t>(world_) ||
        samples.losses.size() != static_cast<size_t>(world_)) {  // none passed: every rank empty
      samples.ids.assign(static_cast<size_t>(world_), {});
      samples.losses.assign(static_cast<size_t>(world_), {});
    }
    check_sample_table(samples);  // before anything counts: every rank raises at the same step
    check_sample_table({{mine.sample_ids}, {mine.sample_losses}});
    expect_stats(mine.local_stats, "local_stats", n_tensors());
    expect_stats(mine.shard_stats, "shard_stats", n_tensors());
    const std::vector<RankStats> rows = rows_of(table, world_);
    count(counters_, v, tokens, counters_.data_position);
    std::string message;
    if (v.anomalous()) {
      RankStep step;
      step.loss = mine.loss;
      step.sample_ids = mine.sample_ids;
      step.sample_losses = mine.sample_losses;
      step.local_checked = mine.local_stats.has_value();
      if (mine.local_stats) step.local = GradCheck::read(mine.local_stats->to(at::kCPU));
      if (mine.shard_stats) step.shard = GradCheck::read(mine.shard_stats->to(at::kCPU));
      const Event e = explainer_.event(counters_, step, v, rows, samples, detector_, lr);
      if (!run_dir_.empty()) {  // the file appears with its first event
        if (!events_)
          events_ = std::make_unique<JsonlWriter>(
              fmt::format("{}/diagnostics/rank{}.jsonl", run_dir_, rank_));
        events_->write(to_json(e));
      }
      message = v.decision == Decision::kAbort
                    ? abort_message(e, "the guard saves nothing: your last checkpoint stands",
                                    run_dir_.empty() ? "<run_dir>" : run_dir_)
                    : skip_message(e);
    }
    detector_.record(v);
    return message;
  }

  bool tensors_active() const { return tensors_.active(); }

  // The per-tensor policies (skip.adaptive_clip = "adagc", skip.spike_moment_reset) of the
  // decided step `v`, from every rank's per-tensor partial sums ([W, tensors] fp64, exchanged
  // with the rows): each tensor's factor (1: untouched) and whether its AdamW moments reset, in
  // the guard's parameter order; noted in `v`, the thresholds advanced on a taken step.
  std::pair<std::vector<double>, std::vector<bool>> decide_tensors(const at::Tensor& sums,
                                                                   Verdict& v) {
    expect_table(sums, "the per-tensor sums", world_, n_tensors());
    const TensorActions a = tensors_.decide(tensors_.norms(sums, v.loss_scale), v);
    const std::vector<std::string>& names = tensors_.names();
    std::vector<double> factors(names.size(), 1.0);
    std::vector<bool> resets(names.size(), false);
    for (size_t i = 0; i < names.size(); ++i) {
      if (const auto f = a.factors.find(names[i]); f != a.factors.end()) factors[i] = f->second;
      resets[i] = a.reset.contains(names[i]);
    }
    return {factors, resets};
  }

  std::string state() const {
    nlohmann::json j = counters_json(counters_);
    j["detector"] = detector_.state();
    if (tensors_.active()) j["detector"]["tensors"] = tensors_.state();
    j["loss_scale"] = detector_.loss_scale_state();
    return j.dump();
  }

  void load_state(const std::string& text) {
    const nlohmann::json j = nlohmann::json::parse(text);
    RunCounters c;
    read_counters(j, c);
    detector_.load_state(j.at("detector"));
    if (tensors_.active() && j.at("detector").contains("tensors"))  // else: a fresh warm-up
      tensors_.load_state(j.at("detector").at("tensors"));
    detector_.load_loss_scale(j.value("loss_scale", nlohmann::json::object()));
    if (config_.skip.reset_guards_on_resume) detector_.reset_guards();
    counters_ = c;
    counters_.world_size = world_;
    device_.reset();  // the device's state is uploaded again from the host's
  }

  py::dict counters() const {
    py::dict d;
    for (const RunCounter& f : kRunCounters) d[f.name] = counters_.*f.field;
    d["consecutive_skips"] = detector_.consecutive_skips();
    d["loss_scale"] = detector_.loss_scale();
    return d;
  }

 private:
  int64_t n_tensors() const { return static_cast<int64_t>(tensors_.names().size()); }

  static std::vector<NamedTensor> unnamed(std::vector<std::string> names) {
    std::vector<NamedTensor> out;
    for (auto& n : names) out.push_back({std::move(n), at::Tensor()});
    return out;
  }

  Config config_;
  int rank_, world_;
  SkipDetector detector_;
  TensorPolicies tensors_;
  Explainer explainer_;
  std::string run_dir_;
  RunCounters counters_;
  std::unique_ptr<DeviceDecision> device_;
  std::unique_ptr<JsonlWriter> events_;
};

// The check of one set of gradients (or the part [offset, offset + length) of their
// concatenation): GradCheck, rebuilt when a tensor's memory moved since the last run.
class Check {
 public:
  Check(std::vector<std::string> names, int64_t offset, int64_t length)
      : names_(std::move(names)), offset_(offset), length_(length) {}

  at::Tensor run(const std::vector<at::Tensor>& grads) {
    if (!check_ || !same_memory(grads)) {
      check_ = std::make_unique<GradCheck>(named(names_, grads), offset_, length_);
      pointers_.clear();
      for (const auto& g : grads) pointers_.push_back(g.const_data_ptr());
    }
    return check_->run();
  }

 private:
  bool same_memory(const std::vector<at::Tensor>& grads) const {
    if (grads.size() != pointers_.size()) return false;
    for (size_t i = 0; i < grads.size(); ++i)
      if (grads[i].const_data_ptr() != pointers_[i]) return false;
    return true;
  }
  std::vector<std::string> names_;
  int64_t offset_, length_;
  std::unique_ptr<GradCheck> check_;
  std::vector<const void*> pointers_;
};

}  // namespace
}  // namespace lockstep

PYBIND11_MODULE(_C, m) {
  using namespace lockstep;
  m.doc() = "lockstep's check and decision (the harness's sources), for PyTorch trainers";
  py::register_exception<ConfigError>(m, "ConfigError", PyExc_ValueError);

  m.attr("STATS_FIELDS") = py::make_tuple("shard_nonfinite", "shard_sumsq", "local_nonfinite",
                                          "local_sumsq", "loss", "stop_requested",
                                          "overflow_runs", "bad_samples", "compute_seconds");
  static_assert(kRankStatsDoubles == 9, "the field list above is RankStats'");
  m.attr("STATS_HEADER") = kernels::kStatsHeader;

  py::class_<Verdict>(m, "Verdict")
      .def_property_readonly("decision",
                             [](const Verdict& v) { return std::string(decision_name(v.decision)); })
      .def_readonly("reasons", &Verdict::reasons)
      .def_readonly("guard", &Verdict::guard)
      .def_readonly("grad_norm", &Verdict::grad_norm)
      .def_readonly("nonfinite", &Verdict::nonfinite)
      .def_readonly("loss", &Verdict::loss)
      .def_readonly("stop", &Verdict::stop)
      .def_readonly("grad_norm_z", &Verdict::grad_norm_z)
      .def_readonly("loss_z", &Verdict::loss_z)
      .def_readonly("culprit_ranks", &Verdict::culprit_ranks)
      .def_readonly("scope", &Verdict::scope)
      .def_readonly("cause", &Verdict::cause)
      .def_readonly("clip_to", &Verdict::clip_to)
      .def_readonly("clip", &Verdict::clip)
      .def_readonly("loss_scale", &Verdict::loss_scale)
      .def_readonly("tensors_clipped", &Verdict::tensors_clipped)
      .def_readonly("moments_reset", &Verdict::moments_reset)
      .def_property_readonly("updates", &Verdict::updates)
      .def_property_readonly("anomalous", &Verdict::anomalous)
      .def("__repr__", [](const Verdict& v) {
        return fmt::format("Verdict({}, reasons=[{}], grad_norm={:.6g}, loss={:.6g}, clip={:.6g})",
                           decision_name(v.decision), fmt::join(v.reasons, ", "), v.grad_norm,
                           v.loss, v.clip);
      });

  py::class_<LocalStep>(m, "LocalStep")
      .def(py::init<>())
      .def_readwrite("loss", &LocalStep::loss)
      .def_readwrite("local_stats", &LocalStep::local_stats)
      .def_readwrite("shard_stats", &LocalStep::shard_stats)
      .def_readwrite("sample_ids", &LocalStep::sample_ids)
      .def_readwrite("sample_losses", &LocalStep::sample_losses);

  py::class_<SampleTable>(m, "SampleTable")
      .def(py::init<>())
      .def_readwrite("ids", &SampleTable::ids)
      .def_readwrite("losses", &SampleTable::losses);

  py::class_<Core>(m, "Core")
      .def(py::init<const std::string&, const std::string&, const std::vector<Override>&, int, int,
                    std::vector<std::string>, const std::string&, const std::string&,
                    const std::string&>(),
           py::arg("toml_text"), py::arg("origin"), py::arg("overrides"), py::arg("rank"),
           py::arg("world"), py::arg("names"), py::arg("run_dir"), py::arg("host"),
           py::arg("device"))
      .def("config_json", &Core::config_json)
      .def("decide", &Core::decide, py::arg("table"))
      .def("decide_on_device", &Core::decide_on_device, py::arg("table"), py::arg("step"))
      .def("read_device", &Core::read_device, py::arg("step"))
      .def("tensors_active", &Core::tensors_active)
      .def("decide_tensors", &Core::decide_tensors, py::arg("sums"), py::arg("verdict"))
      .def("finish", &Core::finish, py::arg("verdict"), py::arg("table"), py::arg("mine"),
           py::arg("samples"), py::arg("lr"), py::arg("tokens"))
      .def("state", &Core::state)
      .def("load_state", &Core::load_state, py::arg("text"))
      .def("counters", &Core::counters);

  // The per-tensor actions decided on the device (optim/tensor_values.h): op 0 multiplies each
  // target by values[index] (1: untouched), op 1 zeroes it where that is 1.
  m.def(
      "apply_tensor_values",
      [](const std::vector<at::Tensor>& targets, const std::vector<int32_t>& index,
         const at::Tensor& values, int op) {
        apply_tensor_values(targets, index, values, static_cast<kernels::TensorOp>(op));
      },
      py::arg("targets"), py::arg("index"), py::arg("values"), py::arg("op"));

  py::class_<Check>(m, "Check")
      .def(py::init<std::vector<std::string>, int64_t, int64_t>(), py::arg("names"),
           py::arg("offset") = 0, py::arg("length") = -1)
      .def("run", &Check::run, py::arg("grads"));
}
