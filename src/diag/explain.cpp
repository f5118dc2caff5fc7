#include "diag/explain.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace lockstep {
namespace {

std::string brief_ids(const std::vector<int64_t>& ids) {
  if (ids.size() <= 8) return fmt::format("[{}]", fmt::join(ids, ", "));
  return fmt::format("[{}, ... {} in all]",
                     fmt::join(std::vector<int64_t>(ids.begin(), ids.begin() + 8), ", "),
                     ids.size());
}

std::string culprits_text(const std::vector<int>& culprits) {
  if (culprits.empty()) return "culprit rank unknown";
  return fmt::format("culprit rank{} {}", culprits.size() > 1 ? "s" : "",
                     fmt::join(culprits, ", "));
}

std::vector<Event::RankRow> rank_rows(const std::vector<RankStats>& table, double scale) {
  std::vector<Event::RankRow> rows;
  for (size_t r = 0; r < table.size(); ++r) {
    Event::RankRow row;
    row.rank = static_cast<int>(r);
    row.loss = table[r].loss;
    row.local_grad_norm = norm_of(table[r].local_nonfinite, table[r].local_sumsq) / scale;
    row.local_nonfinite = static_cast<int64_t>(table[r].local_nonfinite);
    row.shard_nonfinite = static_cast<int64_t>(table[r].shard_nonfinite);
    row.bad_samples = static_cast<int64_t>(table[r].bad_samples);
    rows.push_back(row);
  }
  return rows;
}

}  // namespace

std::vector<int64_t> suspect_samples(const Verdict& v, const SampleTable& t) {
  std::vector<int64_t> bad, all;
  for (int r : v.culprit_ranks)
    for (size_t i = 0; i < t.ids[r].size(); ++i) {
      all.push_back(t.ids[r][i]);
      if (!std::isfinite(t.losses[r][i])) bad.push_back(t.ids[r][i]);
    }
  return bad.empty() ? all : bad;
}

std::vector<Event::Param> top_params(const std::vector<NamedTensor>& grads,
                                     const GradCheckStats& s, int64_t k, double scale) {
  std::vector<size_t> idx(s.tensor_nonfinite.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  auto norm_key = [&](size_t i) {
    return std::isfinite(s.tensor_sumsq[i]) ? s.tensor_sumsq[i] : -1.0;
  };
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
    if (s.tensor_nonfinite[a] != s.tensor_nonfinite[b])
      return s.tensor_nonfinite[a] > s.tensor_nonfinite[b];
    return norm_key(a) > norm_key(b);
  });
  std::vector<Event::Param> out;
  for (size_t j = 0; j < idx.size() && static_cast<int64_t>(j) < k; ++j)
    out.push_back({grads[idx[j]].name, static_cast<int64_t>(s.tensor_nonfinite[idx[j]]),
                   norm_of(s.tensor_nonfinite[idx[j]], s.tensor_sumsq[idx[j]]) / scale,
                   std::sqrt(s.tensor_sumsq[idx[j]]) / scale});
  return out;
}

Explainer::Explainer(const SkipConfig& thresholds, int64_t top_params, int rank,
                     std::vector<NamedTensor> grads)
    : thresholds_(thresholds), top_params_(top_params), rank_(rank), grads_(std::move(grads)) {}

Event Explainer::event(int64_t step, const TrainState& before, const RankStep& mine,
                       const Verdict& v, const std::vector<RankStats>& table,
                       const SampleTable& samples, const SkipDetector& detector,
                       double lr) const {
  const bool skip = v.decision == Decision::kSkip && !v.overflow;
  const double scale = v.loss_scale;  // the checks see scaled gradients; events show them unscaled
  Event e;
  e.step = step;
  e.decision = decision_name(v.decision);
  e.reasons = v.reasons;
  e.guard = v.guard;
  e.global = {v.grad_norm, v.nonfinite, v.loss, v.overflow_runs, v.grad_norm_z, v.loss_z, scale};
  e.window = {detector.history(), detector.grad_norms().mean(), detector.grad_norms().stddev(),
              detector.losses().mean(), detector.losses().stddev()};
  e.thresholds = {thresholds_.max_grad_norm, thresholds_.grad_norm_zscore,
                  thresholds_.loss_zscore, thresholds_.min_history};
  e.rank = rank_;
  const GradCheckStats& own = mine.local_checked ? mine.local : mine.shard;
  e.local = {mine.loss,
             mine.local_checked ? norm_of(own.nonfinite, own.sumsq) / scale : Event::kNaN,
             mine.local_checked ? std::sqrt(own.sumsq) / scale : Event::kNaN,
             static_cast<int64_t>(mine.local.nonfinite),
             fault_name(mine.fault),
             mine.sample_ids,
             mine.sample_losses,
             mine.local_checked ? "local" : "shard",
             top_params(grads_, own, top_params_, scale)};
  e.ranks = rank_rows(table, scale);
  e.culprit_ranks = v.culprit_ranks;
  e.suspect_sample_ids = suspect_samples(v, samples);
  e.lr = lr;
  e.counters = {step, before.optimizer_steps, before.skipped_steps + (skip ? 1 : 0),
                detector.consecutive_skips() + (skip ? 1 : 0),
                before.overflow_skips + (v.overflow ? 1 : 0)};
  return e;
}

std::string skip_message(const Event& e) {
  if (e.reasons == std::vector<std::string>{"loss_scale_overflow"})
    return fmt::format(
        "step {}: SKIP (loss_scale_overflow) | {} nonfinite gradient elements at loss scale {:g}, "
        "every loss finite: an fp16 overflow, not bad data; the scale backs off | weights and "
        "optimizer state untouched; {} overflow skips",
        e.step, static_cast<int64_t>(e.global.nonfinite), e.global.loss_scale,
        e.counters.overflow_skips);
  return fmt::format(
      "step {}: SKIP ({}) | grad_norm {:.4g}, {} nonfinite, loss {:.4g} | {} | samples {} | "
      "weights and optimizer state untouched; skipped {} of {}",
      e.step, fmt::join(e.reasons, ", "), e.global.grad_norm,
      static_cast<int64_t>(e.global.nonfinite), e.global.loss, culprits_text(e.culprit_ranks),
      brief_ids(e.suspect_sample_ids), e.counters.skipped_steps, e.step);
}

std::string abort_message(const Event& e, const std::string& saved, const std::string& run_dir) {
  if (e.reasons == std::vector<std::string>{"loss_scale_overflow"})
    return fmt::format(
        "step {}: aborted on loss_scale_overflow ({}) | {} nonfinite gradient elements at loss "
        "scale {:g} with every loss finite, {} overflow skips in all | {}; the fp16 gradients "
        "keep overflowing: look at the loss and grad_norm before this step (instability), or "
        "train in bfloat16 (training.mixed_precision_param)",
        e.step, e.guard, static_cast<int64_t>(e.global.nonfinite), e.global.loss_scale,
        e.counters.overflow_skips, saved);
  return fmt::format(
      "step {}: aborted on {} ({}) | grad_norm {:.4g}, {} nonfinite, loss {:.4g} | {} | "
      "samples {} | {}; details in {}/diagnostics; exclude the samples with `lockstep diag "
      "{}` and data.exclude_ids_file, or enable skip.enabled",
      e.step, fmt::join(e.reasons, ", "), e.guard, e.global.grad_norm,
      static_cast<int64_t>(e.global.nonfinite), e.global.loss, culprits_text(e.culprit_ranks),
      brief_ids(e.suspect_sample_ids), saved, run_dir, run_dir);
}

}  // namespace lockstep
