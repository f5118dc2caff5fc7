#include "decide/detector.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace lockstep {

const char* decision_name(Decision d) {
  switch (d) {
    case Decision::kStep: return "step";
    case Decision::kSkip: return "skip";
    case Decision::kAbort: return "abort";
  }
  return "?";
}

// ---- Window ---------------------------------------------------------------------------------

void Window::push(double v) {
  values_.push_back(v);
  while (static_cast<int64_t>(values_.size()) > capacity_) values_.pop_front();
}

double Window::mean() const {
  if (values_.empty()) return std::numeric_limits<double>::quiet_NaN();
  double s = 0;
  for (double v : values_) s += v;
  return s / static_cast<double>(values_.size());
}

double Window::stddev() const {
  if (values_.empty()) return std::numeric_limits<double>::quiet_NaN();
  const double m = mean();
  double s = 0;
  for (double v : values_) s += (v - m) * (v - m);
  return std::sqrt(s / static_cast<double>(values_.size()));
}

double Window::zscore(double v) const {
  const double m = mean();
  const double sd = std::max(stddev(), 1e-12 * std::abs(m));
  if (sd == 0) return v > m ? std::numeric_limits<double>::infinity() : 0.0;
  return (v - m) / sd;
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

// The global numbers: every rank adds the same numbers in the same order (rank order).
Verdict reduce_in_rank_order(const std::vector<RankStats>& ranks, bool& loss_nonfinite) {
  Verdict v;
  double sumsq = 0, loss_sum = 0;
  loss_nonfinite = false;
  for (const RankStats& r : ranks) {
    v.nonfinite += r.shard_nonfinite;
    sumsq += r.shard_sumsq;
    v.overflow_runs += r.overflow_runs;
    loss_sum += r.loss;
    v.stop = v.stop || r.stop_requested != 0;
    loss_nonfinite = loss_nonfinite || !std::isfinite(r.loss);
  }
  v.grad_norm = norm_of(v.nonfinite, sumsq);  // never report a partial norm as the norm
  v.loss = ranks.empty() ? kNaN : loss_sum / static_cast<double>(ranks.size());
  return v;
}

// Culprits: the ranks whose own batch shows the problem before the sync mixed it in.
std::vector<int> culprit_ranks(const Verdict& v, const std::vector<RankStats>& ranks,
                               bool nonfinite) {
  std::vector<int> out;
  auto add = [&](int r) {
    if (std::find(out.begin(), out.end(), r) == out.end()) out.push_back(r);
  };
  auto argmax = [&](auto key) {
    int best = 0;
    for (int r = 1; r < static_cast<int>(ranks.size()); ++r)
      if (key(ranks[r]) > key(ranks[best])) best = r;
    return best;
  };
  bool have_local = false;
  for (const RankStats& r : ranks)
    have_local = have_local || r.local_sumsq > 0 || r.local_nonfinite > 0;
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r)
    if (nonfinite && (ranks[r].local_nonfinite > 0 || ranks[r].bad_samples > 0 ||
                      !std::isfinite(ranks[r].loss)))
      add(r);
  for (const auto& reason : v.reasons) {
    if ((reason == "grad_norm_above_max" || reason == "grad_norm_spike") && have_local)
      add(argmax([](const RankStats& s) { return s.local_sumsq; }));
    if (reason == "loss_spike") add(argmax([](const RankStats& s) { return s.loss; }));
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

double norm_of(double nonfinite, double sumsq) {
  return nonfinite > 0 ? kNaN : std::sqrt(sumsq);
}

Verdict SkipDetector::decide(const std::vector<RankStats>& ranks) const {
  static const LossScaler kOff{TrainingConfig{}};
  return decide(ranks, kOff);
}

Verdict SkipDetector::decide(const std::vector<RankStats>& ranks,
                             const LossScaler& scaler) const {
  bool loss_nonfinite = false;
  Verdict v = reduce_in_rank_order(ranks, loss_nonfinite);
  v.loss_scale = scaler.scale();
  if (v.loss_scale != 1.0) v.grad_norm /= v.loss_scale;  // the norm users read is unscaled
  if (scaler.enabled() && v.nonfinite > 0 && !loss_nonfinite) {
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

  if (v.nonfinite > 0) v.reasons.push_back("nonfinite_grad");
  if (loss_nonfinite) v.reasons.push_back("nonfinite_loss");
  const bool nonfinite = !v.reasons.empty();
  if (cfg_.enabled) {
    if (cfg_.max_grad_norm > 0 && std::isfinite(v.grad_norm) && v.grad_norm > cfg_.max_grad_norm)
      v.reasons.push_back("grad_norm_above_max");
    if (cfg_.grad_norm_zscore > 0 && v.grad_norm_z > cfg_.grad_norm_zscore)
      v.reasons.push_back("grad_norm_spike");
    if (cfg_.loss_zscore > 0 && v.loss_z > cfg_.loss_zscore) v.reasons.push_back("loss_spike");
  }
  v.culprit_ranks = culprit_ranks(v, ranks, nonfinite);
  if (v.reasons.empty()) return v;
  if (!cfg_.enabled) {  // stock behaviour: a nonfinite value stops the job
    v.decision = Decision::kAbort;
    v.guard = "skip.enabled = false";
    return v;
  }
  v.decision = Decision::kSkip;
  v.guard = guard_tripped();
  if (!v.guard.empty()) v.decision = Decision::kAbort;
  return v;
}

std::string SkipDetector::guard_tripped() const {
  if (cfg_.max_consecutive > 0 && consecutive_ + 1 > cfg_.max_consecutive)
    return "skip.max_consecutive = " + std::to_string(cfg_.max_consecutive) + ": " +
           std::to_string(consecutive_ + 1) + " skips in a row";
  if (cfg_.max_fraction > 0) {
    // Skips among the last fraction_window steps, this one included.
    int64_t skips = recent_skips_ + 1;
    if (static_cast<int64_t>(recent_.size()) == cfg_.fraction_window && recent_.front()) --skips;
    if (static_cast<double>(skips) > cfg_.max_fraction * static_cast<double>(cfg_.fraction_window))
      return "skip.max_fraction = " + nlohmann::json(cfg_.max_fraction).dump() + ": " +
             std::to_string(skips) + " skips in the last " + std::to_string(cfg_.fraction_window) +
             " steps";
  }
  return "";
}

void SkipDetector::record(const Verdict& v) {
  if (v.decision == Decision::kAbort || v.overflow) return;
  const bool skipped = v.decision == Decision::kSkip;
  if (skipped) {
    ++consecutive_;
  } else {
    consecutive_ = 0;
    grad_norms_.push(v.grad_norm);
    losses_.push(v.loss);
  }
  recent_.push_back(skipped);
  recent_skips_ += skipped;
  while (static_cast<int64_t>(recent_.size()) > cfg_.fraction_window) {
    recent_skips_ -= recent_.front();
    recent_.pop_front();
  }
}

nlohmann::json SkipDetector::state() const {
  std::string recent;
  for (bool b : recent_) recent += b ? '1' : '0';
  return {{"grad_norms", std::vector<double>(grad_norms_.values().begin(),
                                             grad_norms_.values().end())},
          {"losses", std::vector<double>(losses_.values().begin(), losses_.values().end())},
          {"consecutive_skips", consecutive_},
          {"recent", recent}};
}

void SkipDetector::load_state(const nlohmann::json& s) {
  grad_norms_.assign(s.at("grad_norms").get<std::vector<double>>());
  losses_.assign(s.at("losses").get<std::vector<double>>());
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
