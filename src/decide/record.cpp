#include "decide/record.h"

#include <ATen/ops/from_blob.h>

#include <cstring>

namespace lockstep {

namespace {

// `n` int64s at `p` as a tensor where the comm's collectives run (NCCL: the GPU).
at::Tensor on_comm(Comm* comm, void* p, int n) {
  const at::Tensor host = at::from_blob(p, {n}, at::kLong);
  return comm->device().is_cpu() ? host : host.to(comm->device());
}

// Back into `p` when the collective ran off the host.
void to_host(const at::Tensor& t, void* p) {
  if (t.is_cpu()) return;
  std::memcpy(p, t.cpu().data_ptr<int64_t>(), sizeof(int64_t) * static_cast<size_t>(t.numel()));
}

const double* row_of(const RankStats& r) { return reinterpret_cast<const double*>(&r); }

}  // namespace

core::StepRecord exchange_record(const core::StepRecord& mine, Comm* comm) {
  core::StepRecord all = mine;
  if (!comm || comm->size() == 1) return all;
  at::Tensor sums = on_comm(comm, &all.sums, core::kRecordSums);
  at::Tensor maxes = on_comm(comm, &all.maxes, core::kRecordMaxes);
  const auto added = comm->all_reduce_sum_async(sums);  // both in flight together
  const auto largest = comm->all_reduce_max_async(maxes);
  added->wait();
  largest->wait();
  to_host(sums, &all.sums);
  to_host(maxes, &all.maxes);
  return all;
}

int64_t exchange_count(int64_t mine, Comm* comm) {
  if (!comm || comm->size() == 1) return mine;
  at::Tensor t = on_comm(comm, &mine, 1);
  comm->all_reduce_sum(t);
  to_host(t, &mine);
  return mine;
}

RecordStep score_by_record(const RankStats& mine, bool dropped, const core::BeforeSync& before,
                           const core::DecideState& s, const core::DecideConfig& c, Comm* comm) {
  const double* row = row_of(mine);
  const int world = comm ? comm->size() : 1;
  RecordStep st;
  st.own = core::own_finding(row, s, c);
  core::StepRecord own{};
  core::record_contribution(row, dropped, st.own, own);
  st.record = exchange_record(own, comm);
  if (s.aborted) {  // what the device's sticky flag does: nothing of the step counts
    float found_inf = 0, grad_scale = 0;
    core::sticky_abort(s, st.result, &found_inf, &grad_scale);
    return st;
  }
  const core::BeforeSync b{nullptr, before.culprits, before.skip_step, before.suspects};
  if (!core::score_record(st.record, world, -1, s, c, b, st.result)) {
    st.counted = true;  // every rank holds the same record: all of them count
    const int64_t below = exchange_count(core::record_below(row, st.record), comm);
    core::score_record(st.record, world, below, s, c, b, st.result);
  }
  return st;
}

RecordVerdict decide_by_record(const SkipDetector& detector, const RankStats& mine, Comm* comm) {
  const RecordStep st = score_by_record(mine, false, core::BeforeSync{},
                                        detector.host_state().s, detector.config(), comm);
  RecordVerdict out;
  out.verdict = detector.decide_own(st.result, mine);
  out.all_measured = st.record.sums.unmeasured == 0;
  if (SkipDetector::needs_table(out.verdict))
    out.table = name_by_record(detector, out.verdict, mine, st.own, comm);
  return out;
}

std::vector<RankStats> name_by_record(const SkipDetector& detector, Verdict& v,
                                      const RankStats& mine, const core::RankFinding& own,
                                      Comm* comm) {
  std::vector<double> named(row_of(mine), row_of(mine) + core::kStatsDoubles);
  named.insert(named.end(), {static_cast<double>(own.reasons), own.samples ? 1.0 : 0.0,
                             own.grad_norm_z, own.loss_z});
  std::vector<RankStats> table;
  std::vector<core::RankFinding> findings;
  for (const auto& q : all_gather_values(comm, named)) {
    RankStats r;
    std::memcpy(static_cast<void*>(&r), q.data(), sizeof r);
    table.push_back(r);
    const double* f = q.data() + core::kStatsDoubles;
    findings.push_back({static_cast<uint32_t>(f[0]), f[1] != 0, f[2], f[3]});
  }
  detector.name(v, table, findings);
  return table;
}

void name_by_record(const SkipDetector& detector, StepJudge::Checked& late, Comm* comm) {
  if (late.mine && SkipDetector::needs_table(late.verdict))
    late.table = name_by_record(detector, late.verdict, *late.mine, late.own, comm);
}

nlohmann::json record_state(const StepJudge& judge, Comm* comm) {
  nlohmann::json j = judge.state();
  const SkipDetector& d = judge.detector();
  if (!d.own_only()) return j;
  // This rank's two windows in one fixed-size message: their lengths, then their values.
  const auto capacity = static_cast<size_t>(d.host_state().s.grad_norms.capacity);
  const auto g = j.at("rank_grad_norms").at(0).get<std::vector<double>>();
  const auto l = j.at("rank_losses").at(0).get<std::vector<double>>();
  std::vector<double> mine(2 + 2 * capacity, 0.0);
  mine[0] = static_cast<double>(g.size());
  mine[1] = static_cast<double>(l.size());
  std::copy(g.begin(), g.end(), mine.begin() + 2);
  std::copy(l.begin(), l.end(), mine.begin() + 2 + static_cast<long>(capacity));
  nlohmann::json gn = nlohmann::json::array(), ls = nlohmann::json::array();
  for (const auto& q : all_gather_values(comm, mine)) {
    const auto at = [&q](size_t from, double n) {
      return std::vector<double>(q.begin() + static_cast<long>(from),
                                 q.begin() + static_cast<long>(from) + static_cast<long>(n));
    };
    gn.push_back(at(2, q[0]));
    ls.push_back(at(2 + capacity, q[1]));
  }
  j["rank_grad_norms"] = gn;
  j["rank_losses"] = ls;
  return j;
}

RecordDecider::RecordDecider(const core::DecideConfig& config, int64_t window,
                             int64_t fraction_window, double loss_scale)
    : config_(config),
      rings_(core::decide_state_doubles(window, fraction_window, 1), 0.0),
      s_(core::fresh_decide_state(rings_.data(), window, fraction_window, 1, loss_scale)) {}

RecordStep RecordDecider::decide(const RankStats& mine, bool dropped,
                                 const core::BeforeSync& before, Comm* comm) {
  RecordStep st = score_by_record(mine, dropped, before, s_, config_, comm);
  if (st.result.why == core::kStickyAbort) return st;
  core::record_step(s_, config_, st.result);
  core::record_own(s_, config_, row_of(mine), dropped, st.result);
  return st;
}

}  // namespace lockstep
