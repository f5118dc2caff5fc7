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

#include "decide/detector.h"
#include "kernels/decision.h"

namespace lockstep {
namespace {

bool has(const std::vector<std::string>& v, const char* s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

void add_unique(std::vector<std::string>& v, const char* s) {
  if (!has(v, s)) v.emplace_back(s);
}

// The core's row of a rank's stats.
const double* row_of(const RankStats& s) {
  static_assert(sizeof(RankStats) == kernels::kStatsDoubles * sizeof(double),
                "RankStats is the core's row");
  return reinterpret_cast<const double*>(&s);
}

// Before the windows fill (skip.max_grad_norm acts from the first step): the ranks whose own
// gradient norm exceeds 4 x the median of the others' (the core's, the device's too).
std::vector<int> cross_rank_outliers(const std::vector<RankStats>& ranks) {
  std::vector<int> out;
  std::vector<double> scratch(ranks.size());
  const auto stat = [&ranks](int i, int f) { return row_of(ranks[i])[f]; };
  kernels::cross_rank_outliers(stat, static_cast<int>(ranks.size()), scratch.data(),
                               [&out](int r) { out.push_back(r); });
  return out;
}

}  // namespace

bool LocalFindings::local(size_t world) const {
  return kernels::is_local(static_cast<int>(outliers.size()), static_cast<int>(world),
                           sample_evidence);
}

LocalFindings SkipDetector::local_findings(const std::vector<RankStats>& ranks,
                                           double scale) const {
  LocalFindings f;
  const size_t world = ranks.size();
  const bool windows = rank_losses_.size() == world;
  const Window none;
  for (size_t r = 0; r < world; ++r) {
    const Window& g = windows ? rank_grad_norms_[r] : none;
    const Window& l = windows ? rank_losses_[r] : none;
    const kernels::RankFinding k = kernels::rank_finding(
        row_of(ranks[r]), scale, [&g](int64_t i) { return g.values()[i]; }, g.size(),
        [&l](int64_t i) { return l.values()[i]; }, l.size(), cfg_.min_history,
        {cfg_.enabled, cfg_.max_grad_norm, cfg_.grad_norm_zscore, cfg_.loss_zscore});
    f.grad_norm_z.push_back(k.grad_norm_z);
    f.loss_z.push_back(k.loss_z);
    f.sample_evidence = f.sample_evidence || k.samples;
    if (k.reasons == 0) continue;
    f.outliers.push_back(static_cast<int>(r));
    for (int b = 0; b < kernels::kReasonCount; ++b)
      if (k.reasons & (1u << b)) add_unique(f.reasons, reason_name(b));
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
    local = kernels::is_local(static_cast<int>(outliers.size()), static_cast<int>(ranks.size()),
                              false);
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
      uint32_t bits = 0;
      if (has(v.reasons, "grad_norm_spike")) bits |= kernels::kGradNormSpike;
      if (has(v.reasons, "grad_norm_above_max")) bits |= kernels::kGradNormAboveMax;
      const auto gn = [this](int64_t i) { return grad_norms_.values()[i]; };
      v.clip_to = kernels::spike_clip_to(
          bits, gn, grad_norms_.size(),
          {cfg_.enabled, cfg_.max_grad_norm, cfg_.grad_norm_zscore, cfg_.loss_zscore});
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
