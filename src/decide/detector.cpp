#include "decide/detector.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "decide/names.h"
#include "lockstep/error.h"

namespace lockstep {

double norm_of(double nonfinite, double sumsq) { return core::norm_of(nonfinite, sumsq); }

core::DecideConfig decide_config(const SkipConfig& k, const TrainingConfig& t) {
  const LossScaleMode mode = loss_scale_setting(t).mode;
  core::DecideConfig c;
  c.thresholds = {k.enabled, k.max_grad_norm, k.grad_norm_zscore, k.loss_zscore};
  c.min_history = k.min_history;
  c.max_norm = t.max_norm;
  c.loss_scale = {mode != LossScaleMode::kNone, mode == LossScaleMode::kDynamic,
                  t.loss_scale_growth_factor, t.loss_scale_backoff_factor,
                  t.loss_scale_growth_interval};
  c.loss_scale_max_overflows = t.loss_scale_max_overflows;
  c.loss_scale_min = t.loss_scale_min;
  c.max_consecutive = k.max_consecutive;
  c.max_consecutive_seconds = k.max_consecutive_seconds;
  c.max_fraction = k.max_fraction;
  c.fraction_window = k.fraction_window;
  c.on_global_spike = k.on_global_spike == OnGlobalSpike::kClip   ? core::kSpikeClip
                      : k.on_global_spike == OnGlobalSpike::kSkip ? core::kSpikeSkip
                                                                  : core::kSpikeAbort;
  c.hardware_abort = k.on_hardware_fault == OnHardwareFault::kAbort ? 1 : 0;
  c.zclip = {k.adaptive_clip == AdaptiveClip::kZClip ? 1 : 0, k.zclip_alpha, k.zclip_zscore,
             k.zclip_warmup};
  return c;
}

SkipConfig with_token_guard(SkipConfig k, int64_t tokens_per_step) {
  if (k.max_consecutive_tokens <= 0) return k;
  const int64_t steps = k.max_consecutive_tokens / tokens_per_step;
  if (steps < 1)
    throw ConfigError(fmt::format(
        "invalid value for 'skip.max_consecutive_tokens': {} is less than one step's {} tokens "
        "(it would abort on the first skip); raise it to at least {} or set it to 0",
        k.max_consecutive_tokens, tokens_per_step, tokens_per_step));
  if (k.max_consecutive > 0 && k.max_consecutive <= steps) {
    k.max_consecutive_tokens = 0;  // the steps act: the guard's messages name them
    return k;
  }
  k.max_consecutive = steps;
  return k;
}

// ---- HostDecideState --------------------------------------------------------------------------

HostDecideState::HostDecideState(int64_t window, int64_t fraction_window, int w, double scale)
    : rings(core::decide_state_doubles(window, fraction_window, w), 0.0),
      s(core::fresh_decide_state(rings.data(), window, fraction_window, w, scale)),
      world(w) {}

HostDecideState::HostDecideState(const HostDecideState& o)
    : rings(o.rings), s(core::relocated(o.s, o.rings.data(), rings.data())), world(o.world) {}

HostDecideState& HostDecideState::operator=(const HostDecideState& o) {
  if (this == &o) return *this;
  rings = o.rings;
  s = core::relocated(o.s, o.rings.data(), rings.data());
  world = o.world;
  return *this;
}

HostDecideState HostDecideState::resized(int w) const {
  HostDecideState out(s.grad_norms.capacity, s.recent.capacity, w, s.scale.scale);
  const int64_t global = 2 * s.grad_norms.capacity + s.recent.capacity;  // the first rings
  std::copy(rings.begin(), rings.begin() + global, out.rings.begin());
  core::DecideState moved = core::relocated(s, rings.data(), out.rings.data());
  moved.ranks = out.s.ranks;
  moved.scratch = out.s.scratch;
  out.s = moved;
  return out;
}

// ---- SkipDetector -------------------------------------------------------------------------------

SkipDetector::SkipDetector(const SkipConfig& skip, const TrainingConfig& training, int world,
                           int own_rank)
    : config_(decide_config(skip, training)),
      consecutive_tokens_(skip.max_consecutive_tokens),
      world_(world),
      own_rank_(own_rank),
      state_(skip.window, skip.fraction_window, own_rank >= 0 ? 1 : world,
             loss_scale_setting(training).value) {}

HostDecideState SkipDetector::state_for(int world) const {
  return state_.world == world ? state_ : state_.resized(world);
}

std::string SkipDetector::guard_message(const core::DecideResult& r,
                                        const HostDecideState& st) const {
  const core::LossScaleState& ls = st.s.scale;
  switch (r.why) {
    case core::kMaxConsecutive:
      if (consecutive_tokens_ > 0)
        return fmt::format("skip.max_consecutive_tokens = {} ({} steps of the global batch): {} "
                           "skips in a row",
                           consecutive_tokens_, config_.max_consecutive,
                           st.s.consecutive_skips + 1);
      return fmt::format("skip.max_consecutive = {}: {} skips in a row", config_.max_consecutive,
                         st.s.consecutive_skips + 1);
    case core::kMaxSeconds:
      return fmt::format("skip.max_consecutive_seconds = {}: {} skips in a row cost {:.1f} s of "
                         "compute",
                         nlohmann::json(config_.max_consecutive_seconds).dump(),
                         st.s.consecutive_skips + 1, st.s.consecutive_skip_seconds + r.seconds);
    case core::kMaxFraction:
      return fmt::format("skip.max_fraction = {}: {} skips in the last {} steps",
                         nlohmann::json(config_.max_fraction).dump(), r.skips_in_window,
                         config_.fraction_window);
    case core::kMaxOverflows:
      return fmt::format("training.loss_scale_max_overflows = {}: {} overflows in a row",
                         config_.loss_scale_max_overflows, ls.consecutive_overflows + 1);
    case core::kScaleMin:
      return fmt::format("training.loss_scale_min = {}: the scale would fall to {}",
                         config_.loss_scale_min, ls.scale * config_.loss_scale.backoff_factor);
    case core::kSkipDisabled: return "skip.enabled = false";
    case core::kGlobalSpikeAbort: return "skip.on_global_spike = abort";
    case core::kHardwareFaultAbort: return "skip.on_hardware_fault = abort";
    default: return "";
  }
}

Verdict SkipDetector::verdict_of(const core::DecideResult& r, const HostDecideState& st) const {
  Verdict v;
  v.decision = decision_of(r.outcome, r.clipped != 0, r.salvaged != 0);
  v.why = r.why;
  v.guard = guard_message(r, st);
  v.grad_norm = r.grad_norm;
  v.nonfinite = r.nonfinite;
  v.loss = r.loss;
  v.stop = r.stop != 0;
  v.interrupted = r.interrupted != 0;
  v.overflow_runs = r.overflow_runs;
  v.grad_norm_z = r.grad_norm_z;
  v.loss_z = r.loss_z;
  v.loss_scale = r.loss_scale;
  v.overflow = r.overflow != 0;
  v.clip_to = r.clip_to;
  v.clip = r.clip;
  v.compute_seconds = r.seconds;
  // An fp16 overflow: the loss scale, not the data; no rank is blamed.
  v.reasons = v.interrupted ? 0 : v.overflow ? core::kLossScaleOverflow : r.reasons;
  return v;
}

void SkipDetector::add_rank_values(Verdict& v, const std::vector<RankStats>& ranks) {
  for (size_t i = 0; i < ranks.size(); ++i) {
    const core::RankValues rv =
        core::rank_values(rows_of(ranks) + i * core::kStatsDoubles, v.loss_scale);
    v.rank_grad_norm.push_back(rv.grad_norm);
    v.rank_loss.push_back(rv.loss);
  }
}

Verdict SkipDetector::decide(const std::vector<RankStats>& ranks, const Triage& triage) const {
  const int world = static_cast<int>(ranks.size());
  std::optional<HostDecideState> other;
  const HostDecideState& st = state_.world == world ? state_ : other.emplace(state_for(world));
  std::vector<uint8_t> dropped(ranks.size(), 0);
  for (int r : triage.dropped) dropped[static_cast<size_t>(r)] = 1;
  const core::BeforeSync before{triage.dropped.empty() ? nullptr : dropped.data(),
                                static_cast<int32_t>(triage.culprits.size()),
                                triage.skip_step ? 1 : 0,
                                static_cast<int32_t>(triage.hardware_suspects.size())};
  core::DecideResult r{};
  core::score_step(rows_of(ranks), world, st.s, config_, before, r);
  Verdict v = verdict_of(r, st);
  if (v.interrupted || v.overflow) return v;  // nothing to name: the step did not happen
  add_rank_values(v, ranks);
  v.dropped_ranks = triage.dropped;
  v.replays = triage.replays;
  v.cause = triage.cause;
  v.hardware_suspects = triage.hardware_suspects;
  // Only a step to explain needs the names: each rank against its own windows, the scope.
  if (r.reasons == 0 && triage.culprits.empty() && v.decision == Decision::kStep) return v;
  const LocalFindings f = findings(ranks, st);
  v.rank_findings = f.ranks;
  attribute(v, ranks, f, triage);
  return v;
}

Verdict SkipDetector::decide_own(const core::DecideResult& r, const RankStats& mine) const {
  Verdict v = verdict_of(r, state_);
  if (v.interrupted || v.overflow) return v;
  v.own_values = core::rank_values(reinterpret_cast<const double*>(&mine), r.loss_scale);
  return v;
}

void SkipDetector::name(Verdict& v, const std::vector<RankStats>& table,
                        const std::vector<core::RankFinding>& findings) const {
  if (v.interrupted || v.overflow) return;
  add_rank_values(v, table);
  LocalFindings f;
  for (const core::RankFinding& k : findings) f.add(k);
  v.rank_findings = f.ranks;
  attribute(v, table, f, Triage{});
}

void SkipDetector::record(const Verdict& v) {
  const core::DecideResult r = result_of(v);
  if (own_only()) {  // the record form: the global state and this rank's own windows
    core::record_step(state_.s, config_, r);
    if (r.outcome == core::kTake && !r.overflow && v.own_values)
      core::record_rank_values(state_.s, config_, r, 0, *v.own_values);
    return;
  }
  const int world = static_cast<int>(v.rank_loss.size());
  const bool taken = r.outcome == core::kTake && !r.overflow;
  if (taken && state_.world != world) state_ = state_.resized(world);
  core::record_step(state_.s, config_, r);
  if (!taken) return;
  for (int i = 0; i < world; ++i) {
    if (std::find(v.dropped_ranks.begin(), v.dropped_ranks.end(), i) != v.dropped_ranks.end())
      continue;
    core::record_rank_values(state_.s, config_, r, i,
                             {v.rank_grad_norm[static_cast<size_t>(i)],
                                 v.rank_loss[static_cast<size_t>(i)]});
  }
}

void SkipDetector::reset_guards() {
  state_.s.consecutive_skips = 0;
  state_.s.consecutive_skip_seconds = 0;
  state_.s.recent.head = state_.s.recent.size = 0;
  state_.s.recent_skips = 0;
}

WindowSummary SkipDetector::window() const {
  const core::Ring& g = state_.s.grad_norms;
  const core::Ring& l = state_.s.losses;
  const auto gn = [&g](int64_t i) { return core::ring_at(g, i); };
  const auto ls = [&l](int64_t i) { return core::ring_at(l, i); };
  return {g.size, core::window_mean(gn, g.size), core::window_stddev(gn, g.size),
          core::window_mean(ls, l.size), core::window_stddev(ls, l.size)};
}

// ---- checkpoints --------------------------------------------------------------------------------

namespace {

std::vector<double> values_of(const core::Ring& r) {
  std::vector<double> out;
  for (int64_t i = 0; i < r.size; ++i) out.push_back(core::ring_at(r, i));
  return out;
}

void push_all(core::Ring& r, const nlohmann::json& values) {
  for (const auto& v : values) core::ring_push(r, v.get<double>());
}

}  // namespace

nlohmann::json SkipDetector::state() const {
  const core::DecideState& s = state_.s;
  nlohmann::json rank_gn = nlohmann::json::array(), rank_ls = nlohmann::json::array();
  for (int r = 0; r < state_.world; ++r) {
    rank_gn.push_back(values_of(core::rank_ring(s.ranks, r, 0)));
    rank_ls.push_back(values_of(core::rank_ring(s.ranks, r, 1)));
  }
  std::string recent;
  for (double b : values_of(s.recent)) recent += b != 0 ? '1' : '0';
  return {{"grad_norms", values_of(s.grad_norms)},
          {"losses", values_of(s.losses)},
          {"rank_grad_norms", rank_gn},
          {"rank_losses", rank_ls},
          {"consecutive_skips", s.consecutive_skips},
          {"consecutive_skip_seconds", s.consecutive_skip_seconds},
          {"recent", recent},
          {"zclip",
           {{"count", s.zclip.count}, {"mean", s.zclip.mean}, {"m2", s.zclip.m2},
            {"var", s.zclip.var}}}};
}

void SkipDetector::load_state(const nlohmann::json& j) {
  // Checkpoints before per-rank windows have none: they fill again from here.
  const nlohmann::json rank_gn = j.value("rank_grad_norms", nlohmann::json::array());
  const nlohmann::json rank_ls = j.value("rank_losses", nlohmann::json::array());
  const int world = static_cast<int>(rank_ls.size());
  const bool whole = static_cast<int>(rank_gn.size()) == world;
  // The record form keeps its own rank's windows (those of a job as large as this one).
  const int first = own_only() ? own_rank_ : 0;
  const int last = own_only() ? (world == world_ ? own_rank_ + 1 : 0) : world;
  HostDecideState st(state_.s.grad_norms.capacity, state_.s.recent.capacity,
                     own_only() ? 1 : world, state_.s.scale.scale);
  st.s.scale = state_.s.scale;
  push_all(st.s.grad_norms, j.at("grad_norms"));
  push_all(st.s.losses, j.at("losses"));
  for (int r = first; r < last && whole; ++r) {
    for (const auto& v : rank_gn[static_cast<size_t>(r)])
      core::rank_ring_push(st.s.ranks, r - first, 0, v.get<double>());
    for (const auto& v : rank_ls[static_cast<size_t>(r)])
      core::rank_ring_push(st.s.ranks, r - first, 1, v.get<double>());
  }
  st.s.consecutive_skips = j.at("consecutive_skips").get<int64_t>();
  st.s.consecutive_skip_seconds = j.value("consecutive_skip_seconds", 0.0);  // older: none
  for (char c : j.at("recent").get<std::string>()) core::recent_push(st.s, c == '1');
  if (j.contains("zclip")) {  // checkpoints before ZClip have none: it warms up again
    const nlohmann::json& z = j.at("zclip");
    st.s.zclip = {z.at("count").get<int64_t>(), z.at("mean").get<double>(),
                  z.at("m2").get<double>(), z.at("var").get<double>()};
  }
  state_ = st;
}

nlohmann::json SkipDetector::loss_scale_state() const {
  const core::LossScaleState& s = state_.s.scale;
  return {{"scale", s.scale},
          {"growth_tracker", s.growth_tracker},
          {"consecutive_overflows", s.consecutive_overflows}};
}

void SkipDetector::load_loss_scale(const nlohmann::json& j) {
  if (j.empty()) return;
  core::LossScaleState& s = state_.s.scale;
  if (config_.loss_scale.dynamic) s.scale = j.at("scale").get<double>();
  s.growth_tracker = j.at("growth_tracker").get<int64_t>();
  s.consecutive_overflows = j.at("consecutive_overflows").get<int64_t>();
}

}  // namespace lockstep
