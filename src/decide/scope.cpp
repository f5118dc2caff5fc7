// Who stands out: each rank against its own windows, and the core's scope_of naming the
// culprits of a local anomaly (a minority of ranks, or samples that name themselves: bad data or
// a bad device) or none of a global one (most ranks: the model or the optimizer state, handled as
// skip.on_global_spike says).
#include "decide/detector.h"

namespace lockstep {

bool LocalFindings::local(size_t world) const {
  return core::is_local(static_cast<int>(outliers.size()), static_cast<int>(world),
                        sample_evidence);
}

void LocalFindings::add(const core::RankFinding& k) {
  const auto r = static_cast<int>(ranks.size());
  ranks.push_back(k);
  sample_evidence = sample_evidence || k.samples;
  if (k.reasons == 0) return;
  outliers.push_back(r);
  reasons |= k.reasons;
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
    const core::Ring g = core::rank_ring(st.s.ranks, r, core::kRankGradNorms);
    const core::Ring l = core::rank_ring(st.s.ranks, r, core::kRankLosses);
    const core::RankFinding k = core::rank_finding(
        rows_of(ranks) + r * core::kStatsDoubles, st.s.scale.scale,
        [&g](int64_t i) { return core::ring_at(g, i); }, g.size,
        [&l](int64_t i) { return core::ring_at(l, i); }, l.size, config_.min_history,
        config_.thresholds);
    f.add(k);
  }
  return f;
}

void SkipDetector::attribute(Verdict& v, const std::vector<RankStats>& ranks,
                             const LocalFindings& f, const Triage& triage) const {
  if (!triage.culprits.empty()) {  // settled before the sync
    v.scope = core::kLocal;
    v.culprit_ranks = triage.culprits;
    if (v.reasons == 0) v.reasons = triage.reasons;  // dropped, repaired, or to be skipped
    return;
  }
  if (v.reasons == 0) return;
  std::vector<int> outliers;
  std::vector<double> scratch(ranks.size());
  const auto stat = [&ranks](int i, int field) {
    return rows_of(ranks)[i * core::kStatsDoubles + field];
  };
  v.scope = core::scope_of(
      v.reasons, static_cast<int>(ranks.size()), [&f](int r) { return f.ranks[r]; }, stat,
      scratch.data(), [&outliers](int r) { outliers.push_back(r); });
  if (v.scope == core::kLocal) v.culprit_ranks = outliers;
  if (v.scope == core::kGlobal && (v.reasons & core::kNonfinite) == 0)
    v.cause = kCauseInstability;
}

}  // namespace lockstep
