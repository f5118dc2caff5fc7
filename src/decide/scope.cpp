// The anomaly's scope, culprits and cause, and the policy that turns them into a decision:
//   local   a minority of ranks stand out against their own windows (or samples whose own
//           loss is nonfinite name themselves): bad data or a bad device. The culprits are
//           named; the step is skipped (skip.scope = "step"), or their contributions were
//           dropped before the sync and the rest stepped (skip.scope = "rank", triage.cpp).
//   global  most ranks' own values are elevated, or none stands out while the global value
//           does: the model or the optimizer state, not a batch. No rank is blamed, nothing is
//           quarantined; skip.on_global_spike says clip (default), skip or abort. A nonfinite
//           gradient cannot be clipped: it is skipped whatever the scope.
#include <algorithm>
#include <cmath>
#include <limits>

#include "decide/detector.h"

namespace lockstep {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool has(const std::vector<std::string>& v, const char* s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

void add_unique(std::vector<std::string>& v, const char* s) {
  if (!has(v, s)) v.emplace_back(s);
}

// Before the windows fill (skip.max_grad_norm acts from the first step): the ranks whose own
// gradient norm exceeds 4 x the median of the others'.
std::vector<int> cross_rank_outliers(const std::vector<RankStats>& ranks) {
  std::vector<int> out;
  for (int r = 0; r < static_cast<int>(ranks.size()) && ranks.size() > 1; ++r) {
    std::vector<double> others;
    for (int o = 0; o < static_cast<int>(ranks.size()); ++o)
      if (o != r) others.push_back(ranks[o].local_sumsq);
    std::nth_element(others.begin(), others.begin() + others.size() / 2, others.end());
    if (ranks[r].local_sumsq > 16.0 * others[others.size() / 2]) out.push_back(r);  // norm 4x
  }
  return out;
}

}  // namespace

LocalFindings SkipDetector::local_findings(const std::vector<RankStats>& ranks,
                                           double scale) const {
  LocalFindings f;
  const size_t world = ranks.size();
  f.grad_norm_z.assign(world, kNaN);
  f.loss_z.assign(world, kNaN);
  const bool windows = rank_losses_.size() == world;
  for (size_t r = 0; r < world; ++r) {
    const RankStats& s = ranks[r];
    std::vector<std::string> why;
    if (s.local_nonfinite > 0) why.emplace_back("nonfinite_grad");
    if (!std::isfinite(s.loss) || s.bad_samples > 0) why.emplace_back("nonfinite_loss");
    f.sample_evidence = f.sample_evidence || s.bad_samples > 0;
    if (windows && rank_losses_[r].size() >= cfg_.min_history) {
      const double g = norm_of(s.local_nonfinite, s.local_sumsq) / scale;
      if (std::isfinite(g)) f.grad_norm_z[r] = rank_grad_norms_[r].zscore(g);
      if (std::isfinite(s.loss)) f.loss_z[r] = rank_losses_[r].zscore(s.loss);
      if (cfg_.grad_norm_zscore > 0 && f.grad_norm_z[r] > cfg_.grad_norm_zscore)
        why.emplace_back("grad_norm_spike");
      if (cfg_.loss_zscore > 0 && f.loss_z[r] > cfg_.loss_zscore) why.emplace_back("loss_spike");
    }
    if (why.empty()) continue;
    f.outliers.push_back(static_cast<int>(r));
    for (const auto& w : why) add_unique(f.reasons, w.c_str());
  }
  return f;
}

void SkipDetector::attribute(Verdict& v, const std::vector<RankStats>& ranks,
                             const LocalFindings& f, const Triage& triage) const {
  if (!triage.culprits.empty()) {  // settled before the sync
    v.scope = "local";
    v.culprit_ranks = triage.culprits;
    if (v.reasons.empty()) {  // dropped, repaired by their replay, or to be skipped
      v.reasons = triage.reasons;
      if (!triage.skip_step)
        v.decision = triage.dropped.empty() ? Decision::kStep : Decision::kSalvage;
    }
    return;
  }
  if (v.reasons.empty()) return;
  std::vector<int> outliers = f.outliers;
  bool local = f.local(ranks.size());
  if (outliers.empty() && (has(v.reasons, "grad_norm_above_max") ||
                           has(v.reasons, "grad_norm_spike"))) {
    outliers = cross_rank_outliers(ranks);
    local = !outliers.empty() && 2 * outliers.size() <= ranks.size();
  }
  v.scope = local ? "local" : "global";
  if (local) v.culprit_ranks = outliers;
  const bool nonfinite = has(v.reasons, "nonfinite_grad") || has(v.reasons, "nonfinite_loss");
  if (!local && !nonfinite) v.cause = kCauseInstability;
}

void SkipDetector::apply_policy(Verdict& v) const {
  const bool nonfinite = has(v.reasons, "nonfinite_grad") || has(v.reasons, "nonfinite_loss");
  if (v.scope == "global" && !nonfinite) {
    if (cfg_.on_global_spike == OnGlobalSpike::kClip) {
      // Taken, clipped to the largest norm the detector accepts; not a skip (no guard counts).
      double to = std::numeric_limits<double>::infinity();
      if (has(v.reasons, "grad_norm_spike"))
        to = std::min(to, grad_norms_.mean() + cfg_.grad_norm_zscore * grad_norms_.stddev());
      if (has(v.reasons, "grad_norm_above_max")) to = std::min(to, cfg_.max_grad_norm);
      v.clip_to = std::isfinite(to) ? to : 0;
      v.decision = Decision::kClip;
      return;
    }
    if (cfg_.on_global_spike == OnGlobalSpike::kAbort) {
      v.decision = Decision::kAbort;
      v.guard = "skip.on_global_spike = abort";
      return;
    }
  }
  v.decision = Decision::kSkip;
  v.guard = guard_tripped();
  if (!v.guard.empty()) v.decision = Decision::kAbort;
}

}  // namespace lockstep
