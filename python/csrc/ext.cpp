// lockstep._C: the harness's own check, decision, counters and events, bound for PyTorch trainers
// (python/lockstep/torch.py). Nothing here decides or checks anything itself: GradCheck
// (src/check), SkipDetector, TensorPolicies and DeviceDecision (src/decide, over
// src/decide/core/), count()
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

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "check/gradcheck.h"
#include "check/layout.h"
#include "comm/c10d.h"
#include "decide/exchange.h"
#include "decide/exchange_plan.h"
#include "decide/record.h"
#include "decide/judge.h"
#include "decide/names.h"
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

// [W, 9] fp64 (any device) as the rows the host decision reads (decide/exchange.h's stats_of).
std::vector<RankStats> rows_of(const at::Tensor& table, int64_t world) {
  expect_table(table, "the stats table", world, kRankStatsDoubles);
  return stats_of(table.to(at::kCPU, at::kDouble).contiguous());
}

at::Tensor table_of(const std::vector<RankStats>& rows) {
  at::Tensor t = at::empty({static_cast<int64_t>(rows.size()), kRankStatsDoubles}, at::kDouble);
  std::memcpy(t.data_ptr<double>(), rows.data(), sizeof(RankStats) * rows.size());
  return t;
}

// The guard's exchange group (torch.distributed's, found by its registered name) as the trainer's
// Comm: its Gloo backend on the host, or its NCCL backend on `stage` (a GPU), each collective
// under `timeout` seconds.
std::unique_ptr<Comm> comm_of_group(const std::string& group_name, const std::string& stage,
                                    double timeout) {
  const c10::intrusive_ptr<c10d::ProcessGroup> pg = c10d::resolve_process_group(group_name);
  const c10::Device device(stage);
  return comm_over(group_of(pg->getBackend(device.type()), device, to_ms(timeout), pg->getRank(),
                            pg->getSize()));
}

// The one row of this rank ([9] fp64, any device) on the host.
RankStats row_of(const at::Tensor& row) {
  return rows_of(row.reshape({1, -1}), 1).at(0);
}

// This rank's side of a decided step, as the trainer's RankStep holds it.
struct LocalStep {
  double loss = 0;
  std::optional<at::Tensor> local_stats, shard_stats;  // the checks' buffers (any device)
  std::vector<int64_t> sample_ids;
  std::vector<double> sample_losses;
};

// The guard's core: the config read by lockstep's reader and the harness's StepJudge (the host
// decision, which also names what the device decided and keeps the checkpointed state; the
// device decision for a fused Adam/AdamW; the per-tensor policies; the events), with the run's
// counters. The table form: the guard exchanges the rows and the per-tensor sums itself. The
// record form (exchange_over): the harness's own record exchange (decide/record.h) runs over the
// guard's exchange group, and this rank's detector keeps its own windows only.
class Core {
 public:
  Core(const std::string& toml_text, const std::string& origin,
       const std::vector<Override>& overrides, int rank, int world,
       std::vector<std::string> names, const std::string& run_dir, const std::string& host,
       const std::string& device, std::vector<std::string> places)
      : config_(load_config(toml_text, origin, overrides)),
        world_(world),
        n_tensors_(static_cast<int64_t>(names.size())),
        names_(std::move(names)),
        where_{rank, world, host, device, "pytorch", false, std::move(places)},
        run_dir_(run_dir) {
    counters_.world_size = world;
    judge_ = make_judge();
  }

  // What the guard's path exchanges and where it decides (decide/exchange_plan.h, the trainer's
  // rule): the gradients on a GPU, the process group's exchange, a fused Adam/AdamW. Called once,
  // before any step; ConfigError as device_decides.
  ExchangePlan plan(bool on_gpu, const std::string& host_exchange, bool fused) const {
    return plan_exchange(config_, UpdatePath{on_gpu, host_exchange, fused, ""}, world_);
  }

  // The plan's record form: the harness's own record exchange runs over the guard's exchange
  // group `group_name` (`stage`: "cpu" for Gloo, the GPU for NCCL), and this rank's detector
  // keeps its own windows only. Called once, before any step.
  void exchange_records_over(const std::string& group_name, const std::string& stage) {
    comm_ = comm_of_group(group_name, stage, config_.comm.train_timeout_seconds);
    where_.record_form = true;
    judge_ = make_judge();
  }

  std::string config_json() const { return to_json(config_); }

  // The host decision of a step from the all-gathered table ([W, 9]).
  Verdict decide(const at::Tensor& table) const { return judge_->decide(rows_of(table, world_)); }

  // The record form's host decision from this rank's row ([9] fp64): the verdict and the rows
  // gathered for its names ([W, 9], or [0, 9] on a step with nothing to explain).
  std::pair<Verdict, at::Tensor> decide_record(const at::Tensor& row) {
    RecordVerdict r = decide_by_record(judge_->detector(), row_of(row), comm_.get());
    return {std::move(r.verdict), table_of(r.table)};
  }

  // The device decision of `step` (its own state, uploaded from the host's at the first call):
  // found_inf and grad_scale on the table's device, for the fused optimizer; with the
  // per-tensor policies (the table's rows then end with each rank's per-tensor sums) each
  // tensor's factor and reset flag there too (else None).
  py::tuple decide_on_device(const at::Tensor& table, int64_t step) {
    if (comm_)  // the record form: this rank's row
      expect_table(table.reshape({1, -1}), "this rank's row", 1, kRankStatsDoubles);
    else
      expect_table(table, "the stats table", world_,
                   kRankStatsDoubles + (judge_->tensors().active() ? n_tensors_ : 0));
    if (!judge_->on_device()) judge_->start_device(table.device(), comm_.get());
    const DeviceDecision::Update u = judge_->decide_on_device(table, step);
    if (!u.factors.defined()) return py::make_tuple(u.found_inf, u.grad_scale, py::none(), py::none());
    return py::make_tuple(u.found_inf, u.grad_scale, u.factors, u.resets);
  }

  // What the device decided at `step` (one of the last two), decided again on the host from
  // the same table (the per-tensor part too); they must agree bit for bit (else an error
  // naming both). The record form gathers the rows for the names on a step to explain.
  std::pair<Verdict, at::Tensor> read_device(int64_t step) {
    StepJudge::Checked late = judge_->read(step);
    if (comm_) name_by_record(judge_->detector(), late, comm_.get());
    return {std::move(late.verdict), table_of(late.table)};
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
    expect_stats(mine.local_stats, "local_stats", n_tensors_);
    expect_stats(mine.shard_stats, "shard_stats", n_tensors_);
    // The record form gathers no rows on a clean step (nor on one cut short: nothing to name).
    const std::vector<RankStats> rows =
        comm_ && table.numel() == 0 ? std::vector<RankStats>{} : rows_of(table, world_);
    std::string message;
    if (v.anomalous()) {
      const Event e = judge_->explain(counters_, rank_step(mine), v, rows, samples, lr, tokens,
                                     counters_.data_position);
      message = v.decision == Decision::kAbort
                    ? abort_message(e, "the guard saves nothing: your last checkpoint stands",
                                    run_dir_or_placeholder())
                    : skip_message(e);
    }
    judge_->record(counters_, v, tokens, counters_.data_position);
    return message;
  }

  bool tensors_active() { return judge_->tensors().active(); }
  // Whether the decided step `v` needs every rank's per-tensor sums (decide_tensors; the guard
  // gathers them then, as the trainer does: every rank has the same verdict).
  bool needs_tensor_sums(const Verdict& v) const { return judge_->tensors().needs_norms(v); }

  // The per-tensor policies (skip.adaptive_clip = "adagc", skip.spike_moment_reset) of the
  // decided step `v`, from every rank's per-tensor partial sums ([W, tensors] fp64, exchanged
  // with the rows): each tensor's factor (1: untouched) and whether its AdamW moments reset, in
  // the guard's parameter order; noted in `v`, the thresholds advanced on a taken step.
  std::pair<std::vector<double>, std::vector<bool>> decide_tensors(const at::Tensor& sums,
                                                                   Verdict& v) {
    expect_table(sums, "the per-tensor sums", world_, n_tensors_);
    TensorPolicies& tensors = judge_->tensors();
    const TensorActions a = tensors.decide(tensors.norms(sums, v.loss_scale), v);
    const std::vector<std::string>& names = tensors.names();
    std::vector<double> factors(names.size(), 1.0);
    std::vector<bool> resets(names.size(), false);
    for (size_t i = 0; i < names.size(); ++i) {
      if (const auto f = a.factors.find(names[i]); f != a.factors.end()) factors[i] = f->second;
      resets[i] = a.reset.contains(names[i]);
    }
    return {factors, resets};
  }

  // The record form gathers every rank's own windows (a collective: every rank calls it, as
  // torch.distributed.checkpoint and torchtitan do), so the state is the table form's.
  std::string state() const {
    nlohmann::json j = counters_json(counters_);
    j["detector"] = record_state(*judge_, comm_.get());
    j["loss_scale"] = judge_->loss_scale_state();
    return j.dump();
  }

  void load_state(const std::string& text) {
    const nlohmann::json j = nlohmann::json::parse(text);
    RunCounters c;
    read_counters(j, c);
    judge_->load_state(j.at("detector"), j.value("loss_scale", nlohmann::json::object()));
    if (config_.skip.reset_guards_on_resume) judge_->detector().reset_guards();
    counters_ = c;
    counters_.world_size = world_;
  }

  py::dict counters() const {
    py::dict d;
    for (const RunCounter& f : kRunCounters) d[f.name] = counters_.*f.field;
    d["consecutive_skips"] = judge_->detector().consecutive_skips();
    d["loss_scale"] = judge_->detector().loss_scale();
    return d;
  }

 private:
  static std::vector<NamedTensor> unnamed(const std::vector<std::string>& names) {
    std::vector<NamedTensor> out;
    for (const auto& n : names) out.push_back({n, at::Tensor()});
    return out;
  }
  std::unique_ptr<StepJudge> make_judge() const {
    auto judge = std::make_unique<StepJudge>(config_, config_.skip, unnamed(names_), names_,
                                             nullptr, where_);
    if (!run_dir_.empty())  // the file appears with its first event
      judge->open_events(fmt::format("{}/diagnostics/rank{}.jsonl", run_dir_, where_.rank),
                         [](const std::string& w) { warn(w); });
    return judge;
  }
  static void warn(const std::string& message) {  // through Python's logging, as the guard's
    py::gil_scoped_acquire gil;
    py::module_::import("logging").attr("getLogger")("lockstep").attr("warning")(message);
  }
  static RankStep rank_step(const LocalStep& mine) {
    RankStep step;
    step.loss = mine.loss;
    step.sample_ids = mine.sample_ids;
    step.sample_losses = mine.sample_losses;
    step.local_checked = mine.local_stats.has_value();
    if (mine.local_stats) step.local = GradCheck::read(mine.local_stats->to(at::kCPU));
    if (mine.shard_stats) step.shard = GradCheck::read(mine.shard_stats->to(at::kCPU));
    return step;
  }
  std::string run_dir_or_placeholder() const { return run_dir_.empty() ? "<run_dir>" : run_dir_; }

  Config config_;
  int world_;
  int64_t n_tensors_;
  std::vector<std::string> names_;
  StepJudge::Where where_;
  std::string run_dir_;
  std::unique_ptr<Comm> comm_;  // the record form's exchange (null: the table form)
  std::unique_ptr<StepJudge> judge_;
  RunCounters counters_;
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

void bind_verdict(py::module_& m) {
  py::class_<Verdict>(m, "Verdict")
      .def_property_readonly("decision",
                             [](const Verdict& v) { return std::string(decision_name(v.decision)); })
      .def_property_readonly("reasons",
                             [](const Verdict& v) { return reason_names(v.reasons); })
      .def_readonly("guard", &Verdict::guard)
      .def_readonly("grad_norm", &Verdict::grad_norm)
      .def_readonly("nonfinite", &Verdict::nonfinite)
      .def_readonly("loss", &Verdict::loss)
      .def_readonly("stop", &Verdict::stop)
      .def_readonly("grad_norm_z", &Verdict::grad_norm_z)
      .def_readonly("loss_z", &Verdict::loss_z)
      .def_readonly("culprit_ranks", &Verdict::culprit_ranks)
      .def_property_readonly("scope",
                             [](const Verdict& v) { return std::string(scope_name(v.scope)); })
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
                           decision_name(v.decision), fmt::join(reason_names(v.reasons), ", "),
                           v.grad_norm, v.loss, v.clip);
      });

}

void bind_step_types(py::module_& m) {
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

  py::class_<ExchangePlan>(m, "ExchangePlan")
      .def_property_readonly("each",
                             [](const ExchangePlan& p) {
                               return p.record() ? "record" : p.table() ? "table" : "nothing";
                             })
      .def_readonly("on_device", &ExchangePlan::on_device)
      .def_readonly("tensor_sums_each_step", &ExchangePlan::tensor_sums_each_step)
      .def_readonly("tensor_policies", &ExchangePlan::tensor_policies)
      .def_readonly("table_because", &ExchangePlan::table_because)
      .def_readonly("host_because", &ExchangePlan::host_because)
      .def("summary", &ExchangePlan::summary);

  py::class_<Core>(m, "Core")
      .def(py::init<const std::string&, const std::string&, const std::vector<Override>&, int, int,
                    std::vector<std::string>, const std::string&, const std::string&,
                    const std::string&, std::vector<std::string>>(),
           py::arg("toml_text"), py::arg("origin"), py::arg("overrides"), py::arg("rank"),
           py::arg("world"), py::arg("names"), py::arg("run_dir"), py::arg("host"),
           py::arg("device"), py::arg("places") = std::vector<std::string>{})
      .def("config_json", &Core::config_json)
      .def("plan", &Core::plan, py::arg("on_gpu"), py::arg("host_exchange"), py::arg("fused"))
      .def("exchange_records_over", &Core::exchange_records_over, py::arg("group_name"),
           py::arg("stage"))
      .def("decide", &Core::decide, py::arg("table"))
      .def("decide_record", &Core::decide_record, py::arg("row"))
      .def("decide_on_device", &Core::decide_on_device, py::arg("table"), py::arg("step"))
      .def("read_device", &Core::read_device, py::arg("step"))
      .def("tensors_active", &Core::tensors_active)
      .def("needs_tensor_sums", &Core::needs_tensor_sums, py::arg("verdict"))
      .def("decide_tensors", &Core::decide_tensors, py::arg("sums"), py::arg("verdict"))
      .def("finish", &Core::finish, py::arg("verdict"), py::arg("table"), py::arg("mine"),
           py::arg("samples"), py::arg("lr"), py::arg("tokens"))
      .def("state", &Core::state)
      .def("load_state", &Core::load_state, py::arg("text"))
      .def("counters", &Core::counters);

}

void bind_functions(py::module_& m) {
  // check/layout.h: for each tensor, how many ranks hold each element this rank holds, from every
  // rank's holdings ([tensor][rank] -> (mesh's group ranks, mesh shape, placement letters)).
  m.def(
      "element_holders",
      [](const std::vector<std::string>& names,
         const std::vector<std::vector<
             std::tuple<std::vector<int>, std::vector<int64_t>, std::string>>>& holdings,
         int rank) {
        std::vector<std::vector<Holding>> h;
        for (const auto& tensor : holdings) {
          h.emplace_back();
          for (const auto& [ranks, shape, placements] : tensor)
            h.back().push_back({ranks, shape, placements});
        }
        return element_holders(names, h, rank);
      },
      py::arg("names"), py::arg("holdings"), py::arg("rank"));

  // The per-tensor actions decided on the device (optim/tensor_values.h): op 0 multiplies each
  // target by values[index] (1: untouched), op 1 zeroes it where that is 1.
  m.def(
      "apply_tensor_values",
      [](const std::vector<at::Tensor>& targets, const std::vector<int32_t>& index,
         const at::Tensor& values, int op) {
        apply_tensor_values(targets, index, values, static_cast<kernels::TensorOp>(op));
      },
      py::arg("targets"), py::arg("index"), py::arg("values"), py::arg("op"));

  // This rank's row of the stats table (decide/exchange.h: the harness builds the same), on the
  // checks' device with no host read: check [A]'s buffer (None: not checked), check [B]'s, the
  // loss and every sample's loss (fp64), the stop request.
  m.def(
      "rank_row",
      [](const std::optional<at::Tensor>& local, const at::Tensor& shard, const at::Tensor& loss,
         const at::Tensor& sample_losses, double stop) {
        for (const at::Tensor* t : {&shard, &loss, &sample_losses})
          if (t->scalar_type() != at::kDouble || t->device() != shard.device())
            throw std::invalid_argument("rank_row: fp64 tensors on one device");
        if (shard.dim() != 1 || shard.numel() < kernels::kStatsHeader || loss.numel() != 1 ||
            (local && (local->dim() != 1 || local->numel() < 2)))
          throw std::invalid_argument("rank_row: check buffers of at least their header and a "
                                      "one-element loss");
        return rank_row(local ? local->to(shard.device()) : at::Tensor(), shard, loss,
                        sample_losses, stop);
      },
      py::arg("local"), py::arg("shard"), py::arg("loss"), py::arg("sample_losses"),
      py::arg("stop"));

  // An anomalous step's check of the model itself (check/gradcheck.h, decide/judge.h): the
  // tensors holding nonfinite values with their counts; the verdict turned into an abort that
  // blames the model when any rank found one.
  m.def(
      "nonfinite_tensors",
      [](const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors) {
        return nonfinite_tensors(named(names, tensors));
      },
      py::arg("names"), py::arg("tensors"));
  m.def("model_suspect", &model_suspect, py::arg("verdict"));
  m.def("blame_model", &blame_model, py::arg("verdict"), py::arg("counts"), py::arg("mine"));

  py::class_<Check>(m, "Check")
      .def(py::init<std::vector<std::string>, int64_t, int64_t>(), py::arg("names"),
           py::arg("offset") = 0, py::arg("length") = -1)
      .def("run", &Check::run, py::arg("grads"));
}

}  // namespace
}  // namespace lockstep

PYBIND11_MODULE(_C, m) {
  using namespace lockstep;
  m.doc() = "lockstep's check and decision (the harness's sources), for PyTorch trainers";
  py::register_exception<ConfigError>(m, "ConfigError", PyExc_ValueError);

  py::tuple fields(static_cast<size_t>(core::kStatsDoubles));
  for (int f = 0; f < core::kStatsDoubles; ++f) fields[f] = stats_field_name(f);
  m.attr("STATS_FIELDS") = fields;
  m.attr("STATS_HEADER") = kernels::kStatsHeader;

  bind_verdict(m);
  bind_step_types(m);
  bind_functions(m);
}
