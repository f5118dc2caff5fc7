// The names of an anomaly's scope, culprits and cause (the core decides the outcome; this says
// who and why, from the same core functions):
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

LocalFindings SkipDetector::local_findings(const std::vector<RankStats>& ranks) const {
  const int world = static_cast<int>(ranks.size());
  if (state_.world == world) return findings(ranks, state_);
  return findings(ranks, state_for(world));
}

LocalFindings SkipDetector::findings(const std::vector<RankStats>& ranks,
                                     const HostDecideState& st) const {
  LocalFindings f;
  const int world = static_cast<int>(ranks.size());
  for (int r = 0; r < world; ++r) {
    const kernels::Ring g = kernels::rank_ring(st.s.ranks, r, 0);
    const kernels::Ring l = kernels::rank_ring(st.s.ranks, r, 1);
    const kernels::RankFinding k = kernels::rank_finding(
        row_of(ranks[static_cast<size_t>(r)]), st.s.scale.scale,
        [&g](int64_t i) { return kernels::ring_at(g, i); }, g.size,
        [&l](int64_t i) { return kernels::ring_at(l, i); }, l.size, config_.min_history,
        config_.thresholds);
    f.grad_norm_z.push_back(k.grad_norm_z);
    f.loss_z.push_back(k.loss_z);
    f.sample_evidence = f.sample_evidence || k.samples;
    if (k.reasons == 0) continue;
    f.outliers.push_back(r);
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
    if (v.reasons.empty()) v.reasons = triage.reasons;  // dropped, repaired, or to be skipped
    return;
  }
  if (v.reasons.empty()) return;
  std::vector<int> outliers = f.outliers;
  bool local = f.local(ranks.size());
  const bool norm_reason = has(v.reasons, "grad_norm_above_max") ||
                           has(v.reasons, "grad_norm_spike") || has(v.reasons, "grad_norm_zclip");
  if (outliers.empty() && norm_reason) {
    outliers = cross_rank_outliers(ranks);
    local = kernels::is_local(static_cast<int>(outliers.size()), static_cast<int>(ranks.size()),
                              false);
  }
  v.scope = local ? "local" : "global";
  if (local) v.culprit_ranks = outliers;
  const bool nonfinite = has(v.reasons, "nonfinite_grad") || has(v.reasons, "nonfinite_loss");
  if (!local && !nonfinite) v.cause = kCauseInstability;
}

}  // namespace lockstep
