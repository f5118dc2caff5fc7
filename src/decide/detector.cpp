#include "decide/detector.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/decision.h"

namespace lockstep {

const char* decision_name(Decision d) {
  switch (d) {
    case Decision::kStep: return "step";
    case Decision::kSkip: return "skip";
    case Decision::kAbort: return "abort";
    case Decision::kClip: return "clip";
    case Decision::kSalvage: return "salvage";
  }
  return "?";
}

// ---- Window ---------------------------------------------------------------------------------

void Window::push(double v) {
  values_.push_back(v);
  while (static_cast<int64_t>(values_.size()) > capacity_) values_.pop_front();
}

// The window statistics are the shared decision core's (kernels/decision.h), the device's too.
double Window::mean() const {
  return kernels::window_mean([this](int64_t i) { return values_[i]; }, size());
}

double Window::stddev() const {
  return kernels::window_stddev([this](int64_t i) { return values_[i]; }, size());
}

double Window::zscore(double v) const {
  return kernels::window_zscore([this](int64_t i) { return values_[i]; }, size(), v);
}

void Window::assign(const std::vector<double>& values) {
  values_.clear();
  for (double v : values) push(v);
}

// ---- SkipDetector ---------------------------------------------------------------------------

SkipDetector::SkipDetector(const SkipConfig& config)
    : cfg_(config), grad_norms_(config.window), losses_(config.window) {}

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The global numbers, reduced in rank order by the shared core (kernels/decision.h). The loss
// is the mean over the ranks that contributed (not `dropped`).
Verdict reduce_in_rank_order(const std::vector<RankStats>& ranks, const std::vector<int>& dropped,
                             bool& loss_nonfinite) {
  const auto stat = [&ranks](int i, int f) {
    double row[kernels::kStatsDoubles];
    static_assert(sizeof row == sizeof(RankStats), "RankStats is the core's row");
    std::memcpy(row, &ranks[i], sizeof row);
    return row[f];
  };
  const auto out = [&dropped](int i) {
    return std::find(dropped.begin(), dropped.end(), i) != dropped.end();
  };
  const kernels::Global g =
      kernels::reduce_in_rank_order(stat, static_cast<int>(ranks.size()), out);
  Verdict v;
  v.nonfinite = g.nonfinite;
  v.overflow_runs = g.overflow_runs;
  v.stop = g.stop;
  v.grad_norm = g.grad_norm;  // never report a partial norm as the norm
  v.loss = g.loss;
  loss_nonfinite = g.loss_nonfinite;
  return v;
}

// The reasons' names, in the core's bit order.
void name_reasons(uint32_t bits, std::vector<std::string>& out) {
  for (int b = 0; b < kernels::kReasonCount; ++b)
    if (bits & (1u << b)) out.push_back(reason_name(b));
}

}  // namespace

const char* reason_name(int bit) {
  static const char* const kNames[kernels::kReasonCount] = {
      "nonfinite_grad", "nonfinite_loss", "grad_norm_above_max", "grad_norm_spike", "loss_spike"};
  return bit >= 0 && bit < kernels::kReasonCount ? kNames[bit] : "?";
}

double norm_of(double nonfinite, double sumsq) { return kernels::norm_of(nonfinite, sumsq); }

Verdict SkipDetector::decide(const std::vector<RankStats>& ranks) const {
  static const LossScaler kOff{TrainingConfig{}};
  return decide(ranks, kOff);
}

Verdict SkipDetector::decide(const std::vector<RankStats>& ranks, const LossScaler& scaler,
                             const Triage& triage) const {
  bool loss_nonfinite = false;
  Verdict v = reduce_in_rank_order(ranks, triage.dropped, loss_nonfinite);
  v.loss_scale = scaler.scale();
  if (v.loss_scale != 1.0) v.grad_norm /= v.loss_scale;  // the norm users read is unscaled
  if (scaler.enabled() && v.nonfinite > 0 && !loss_nonfinite && triage.culprits.empty()) {
    // An fp16 overflow: the loss scale, not the data. Skip, back off (in record), blame no one.
    v.overflow = true;
    v.reasons.push_back("loss_scale_overflow");
    v.guard = scaler.guard_on_overflow();
    v.decision = v.guard.empty() ? Decision::kSkip : Decision::kAbort;
    v.grad_norm_z = v.loss_z = kNaN;
    return v;
  }
  const bool zscores = history() >= cfg_.min_history;
  v.grad_norm_z = zscores && std::isfinite(v.grad_norm) ? grad_norms_.zscore(v.grad_norm) : kNaN;
  v.loss_z = zscores && std::isfinite(v.loss) ? losses_.zscore(v.loss) : kNaN;

  kernels::Global g;
  g.nonfinite = v.nonfinite;
  g.loss_nonfinite = loss_nonfinite;
  name_reasons(kernels::reasons_of(g, v.grad_norm, v.grad_norm_z, v.loss_z,
                                   {cfg_.enabled, cfg_.max_grad_norm, cfg_.grad_norm_zscore,
                                    cfg_.loss_zscore}),
               v.reasons);
  const LocalFindings f = local_findings(ranks, v.loss_scale);
  for (size_t r = 0; r < ranks.size(); ++r) {
    v.rank_grad_norm.push_back(norm_of(ranks[r].local_nonfinite, ranks[r].local_sumsq) /
                               v.loss_scale);
    v.rank_loss.push_back(ranks[r].loss);
  }
  v.rank_grad_norm_z = f.grad_norm_z;
  v.rank_loss_z = f.loss_z;
  v.dropped_ranks = triage.dropped;
  v.replays = triage.replays;
  v.cause = triage.cause;
  v.hardware_suspects = triage.hardware_suspects;
  const bool synced_clean = v.reasons.empty() && !triage.skip_step;
  attribute(v, ranks, f, triage);
  if (!synced_clean && !cfg_.enabled) {  // stock behaviour: a nonfinite value stops the job
    v.decision = Decision::kAbort;
    v.guard = "skip.enabled = false";
    return v;
  }
  if (!synced_clean) apply_policy(v);
  if (v.decision != Decision::kAbort && !v.hardware_suspects.empty() &&
      cfg_.on_hardware_fault == OnHardwareFault::kAbort) {
    v.decision = Decision::kAbort;
    v.guard = "skip.on_hardware_fault = abort";
  }
  return v;
}

std::string SkipDetector::guard_tripped() const {
  int64_t skips = 0;  // among the last fraction_window steps, this one included
  switch (kernels::guard_tripped(consecutive_, cfg_.max_consecutive, recent_skips_,
                                 static_cast<int64_t>(recent_.size()),
                                 !recent_.empty() && recent_.front(), cfg_.max_fraction,
                                 cfg_.fraction_window, &skips)) {
    case kernels::kMaxConsecutive:
      return "skip.max_consecutive = " + std::to_string(cfg_.max_consecutive) + ": " +
             std::to_string(consecutive_ + 1) + " skips in a row";
    case kernels::kMaxFraction:
      return "skip.max_fraction = " + nlohmann::json(cfg_.max_fraction).dump() + ": " +
             std::to_string(skips) + " skips in the last " + std::to_string(cfg_.fraction_window) +
             " steps";
    case kernels::kNoGuard: break;
  }
  return "";
}

double SkipDetector::bounded(const Window& w, double v, double z) const {
  return kernels::window_bounded([&w](int64_t i) { return w.values()[i]; }, w.size(), v, z,
                                 cfg_.min_history);
}

void SkipDetector::record(const Verdict& v) {
  if (v.decision == Decision::kAbort || v.overflow) return;
  const bool skipped = v.decision == Decision::kSkip;
  const bool clip = v.decision == Decision::kClip;
  if (skipped) {
    ++consecutive_;
  } else {
    consecutive_ = 0;
    // A clip enters as the bound it was taken at: a lasting new level moves the window up
    // step by step; one spike does not widen it.
    grad_norms_.push(clip && v.clip_to > 0 ? std::min(v.grad_norm, v.clip_to) : v.grad_norm);
    losses_.push(clip ? bounded(losses_, v.loss, cfg_.loss_zscore) : v.loss);
    const size_t world = v.rank_loss.size();
    if (rank_losses_.size() != world) {  // a fresh start, or a resume at another world size
      rank_grad_norms_.assign(world, Window(cfg_.window));
      rank_losses_.assign(world, Window(cfg_.window));
    }
    for (size_t r = 0; r < world; ++r) {
      if (std::find(v.dropped_ranks.begin(), v.dropped_ranks.end(), static_cast<int>(r)) !=
          v.dropped_ranks.end())
        continue;
      const double g = v.rank_grad_norm[r], l = v.rank_loss[r];
      rank_grad_norms_[r].push(clip ? bounded(rank_grad_norms_[r], g, cfg_.grad_norm_zscore) : g);
      rank_losses_[r].push(clip ? bounded(rank_losses_[r], l, cfg_.loss_zscore) : l);
    }
  }
  recent_.push_back(skipped);
  recent_skips_ += skipped;
  while (static_cast<int64_t>(recent_.size()) > cfg_.fraction_window) {
    recent_skips_ -= recent_.front();
    recent_.pop_front();
  }
}

void SkipDetector::reset_guards() {
  consecutive_ = 0;
  recent_.clear();
  recent_skips_ = 0;
}

namespace {

std::vector<double> values_of(const Window& w) {
  return std::vector<double>(w.values().begin(), w.values().end());
}

nlohmann::json windows_json(const std::vector<Window>& ws) {
  nlohmann::json out = nlohmann::json::array();
  for (const Window& w : ws) out.push_back(values_of(w));
  return out;
}

std::vector<Window> windows_from(const nlohmann::json& j, int64_t capacity) {
  std::vector<Window> out;
  for (const auto& values : j) {
    out.emplace_back(capacity);
    out.back().assign(values.get<std::vector<double>>());
  }
  return out;
}

}  // namespace

nlohmann::json SkipDetector::state() const {
  std::string recent;
  for (bool b : recent_) recent += b ? '1' : '0';
  return {{"grad_norms", values_of(grad_norms_)},
          {"losses", values_of(losses_)},
          {"rank_grad_norms", windows_json(rank_grad_norms_)},
          {"rank_losses", windows_json(rank_losses_)},
          {"consecutive_skips", consecutive_},
          {"recent", recent}};
}

void SkipDetector::load_state(const nlohmann::json& s) {
  grad_norms_.assign(s.at("grad_norms").get<std::vector<double>>());
  losses_.assign(s.at("losses").get<std::vector<double>>());
  // Checkpoints before per-rank windows have none: they fill again from here.
  rank_grad_norms_ = windows_from(s.value("rank_grad_norms", nlohmann::json::array()), cfg_.window);
  rank_losses_ = windows_from(s.value("rank_losses", nlohmann::json::array()), cfg_.window);
  consecutive_ = s.at("consecutive_skips").get<int64_t>();
  recent_.clear();
  recent_skips_ = 0;
  for (char c : s.at("recent").get<std::string>()) {
    recent_.push_back(c == '1');
    recent_skips_ += c == '1';
  }
  while (static_cast<int64_t>(recent_.size()) > cfg_.fraction_window) {
    recent_skips_ -= recent_.front();
    recent_.pop_front();
  }
}

}  // namespace lockstep
