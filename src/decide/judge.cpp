#include "decide/judge.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>

#include "decide/exchange.h"

namespace lockstep {

bool model_suspect(const Verdict& v) { return v.nonfinite > 0 || !std::isfinite(v.loss); }

void blame_model(Verdict& v, const std::vector<double>& counts,
                 const std::vector<std::pair<std::string, int64_t>>& mine) {
  std::vector<int> ranks;
  for (size_t r = 0; r < counts.size(); ++r)
    if (counts[r] > 0) ranks.push_back(static_cast<int>(r));
  if (ranks.empty()) return;
  std::vector<std::string> named;
  for (size_t i = 0; i < mine.size() && i < 3; ++i)
    named.push_back(fmt::format("{} ({} nonfinite)", mine[i].first, mine[i].second));
  if (mine.size() > 3) named.push_back(fmt::format("... {} tensors in all", mine.size()));
  v.decision = Decision::kAbort;
  v.scope = core::kGlobal;
  v.why = core::kNonfiniteParameters;
  v.cause = kCauseModel;
  v.culprit_ranks.clear();
  v.guard = fmt::format("nonfinite parameters on rank {}{}", fmt::join(ranks, ", "),
                        named.empty() ? "" : fmt::format(": {}", fmt::join(named, ", ")));
}

StepJudge::StepJudge(const Config& c, const SkipConfig& skip, std::vector<NamedTensor> grads,
                     std::vector<std::string> tensors, Comm* comm, Where where)
    : detector_(skip, c.training, where.world, where.record_form ? where.rank : -1),
      tensors_(c.skip, std::move(tensors), comm),
      explainer_(c.skip, c.diagnostics.top_params, where.rank, std::move(grads),
                 std::move(where.host), std::move(where.device), std::move(where.loop),
                 std::move(where.places)),
      world_(where.world),
      rank_(where.rank) {}

void StepJudge::start_device(c10::Device device, Comm* comm) {
  if (detector_.own_only())
    record_device_ = std::make_unique<DeviceRecord>(device, detector_, comm);
  else
    device_ =
        std::make_unique<DeviceDecision>(device, world_, detector_, tensors_.device_start());
}

DeviceDecision::Update StepJudge::decide_on_device(const at::Tensor& t, int64_t step) {
  if (!record_device_) return device_->decide(t, step);
  const DeviceRecord::Update u = record_device_->decide(t, step);
  return {u.found_inf, u.grad_scale, {}, {}};
}

StepJudge::Checked StepJudge::read(int64_t step) {
  if (record_device_) return read_record(step);
  if (!device_) throw std::invalid_argument("read: nothing was decided on the device");
  const DeviceDecision::Readback late = device_->read(step);
  Checked out{detector_.decide(late.table), late.table, late.waited};
  tensors_.mirror(step, late, out.verdict);  // per tensor
  expect_same_decision(step, out.verdict, out.verdict.clip, late.result, late.found_inf,
                       late.grad_scale);
  const auto r = static_cast<size_t>(rank_);
  out.seconds = r < late.table.size() ? late.table[r].compute_seconds : 0;
  out.all_measured = all_measured(late.table);
  return out;
}

StepJudge::Checked StepJudge::read_record(int64_t step) {
  const DeviceRecord::Readback late = record_device_->read(step);
  const core::DecideState& s = detector_.host_state().s;  // the device's before this step
  core::DecideResult r{};
  core::score_record(late.record, world_, late.below, s, detector_.config(), core::BeforeSync{},
                     r);
  Checked out{detector_.decide_own(r, late.mine), {}, late.waited};
  expect_same_decision(step, out.verdict, out.verdict.clip, late.result, late.found_inf,
                       late.grad_scale);
  out.seconds = late.mine.compute_seconds;
  out.all_measured = late.record.sums.unmeasured == 0;
  out.mine = late.mine;
  out.own = core::own_finding(reinterpret_cast<const double*>(&late.mine), s, detector_.config());
  return out;
}

void StepJudge::open_events(const std::string& path,
                            std::function<void(const std::string&)> warn, bool now) {
  events_path_ = path;
  warn_ = std::move(warn);
  if (now) events_ = std::make_unique<JsonlWriter>(path);
}

void StepJudge::write_event(const nlohmann::json& record) {
  if (events_path_.empty()) return;
  try {  // the file appears with its first event
    if (!events_) events_ = std::make_unique<JsonlWriter>(events_path_);
    events_->write(record);
  } catch (const std::exception& err) {  // a side channel: training goes on
    if (!warned_ && warn_)
      warn_(fmt::format("cannot write the diagnostics events to {} ({}); training goes on "
                        "without them (this is said once)",
                        events_path_, err.what()));
    warned_ = true;
  }
}

Event StepJudge::explain(const RunCounters& before, const RankStep& mine, const Verdict& v,
                         const std::vector<RankStats>& table, const SampleTable& samples,
                         double lr, int64_t tokens, int64_t data_position) {
  RunCounters after = before;  // the run's counters as this step leaves them
  count(after, v, tokens, data_position);
  const Event e = explainer_.event(after, mine, v, table, samples, detector_, lr);
  write_event(to_json(e));
  return e;
}

void StepJudge::record(RunCounters& counters, const Verdict& v, int64_t tokens,
                       int64_t data_position) {
  detector_.record(v);  // windows, guards, loss scale: the same verdict, the same state
  count(counters, v, tokens, data_position);
}

nlohmann::json StepJudge::state() const {
  nlohmann::json j = detector_.state();
  if (tensors_.active()) j["tensors"] = tensors_.state();
  return j;
}

void StepJudge::load_state(const nlohmann::json& detector, const nlohmann::json& loss_scale) {
  if (!detector.empty()) detector_.load_state(detector);
  if (tensors_.active() && detector.contains("tensors"))  // else: a fresh warm-up
    tensors_.load_state(detector.at("tensors"));
  detector_.load_loss_scale(loss_scale);
  device_.reset();  // a device decision starts again from the host's state
  record_device_.reset();
}

}  // namespace lockstep
