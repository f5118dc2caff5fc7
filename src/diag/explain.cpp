#include "diag/explain.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "decide/names.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

std::string brief_ids(const std::vector<int64_t>& ids) {
  if (ids.size() <= 8) return fmt::format("[{}]", fmt::join(ids, ", "));
  return fmt::format("[{}, ... {} in all]",
                     fmt::join(std::vector<int64_t>(ids.begin(), ids.begin() + 8), ", "),
                     ids.size());
}

// "5" or, under a device mesh, "5 (pp 1, dp_shard 0, tp 1)".
std::string rank_text(const Event& e, int rank) {
  for (const auto& row : e.ranks)
    if (row.rank == rank) return rank_named(rank, row.place);
  return std::to_string(rank);
}

std::string culprits_text(const Event& e) {
  if (e.culprit_ranks.empty()) return "culprit rank unknown";
  std::vector<std::string> named;
  for (int r : e.culprit_ranks) named.push_back(rank_text(e, r));
  return fmt::format("culprit rank{} {}", named.size() > 1 ? "s" : "", fmt::join(named, ", "));
}

// How many ranks' own values stand out in the event's table (the core's finding per rank).
int64_t elevated_ranks(const Event& e) {
  int64_t elevated = 0;
  for (const auto& r : e.ranks) elevated += r.reasons != 0 ? 1 : 0;
  return elevated;
}

std::vector<Event::RankRow> rank_rows(const std::vector<RankStats>& table, const Verdict& v,
                                      const std::vector<std::string>& places) {
  std::vector<Event::RankRow> rows;
  for (size_t r = 0; r < table.size(); ++r) {
    Event::RankRow row;
    row.rank = static_cast<int>(r);
    if (r < places.size()) row.place = places[r];
    row.loss = table[r].loss;
    row.local_grad_norm = norm_of(table[r].local_nonfinite, table[r].local_sumsq) / v.loss_scale;
    row.local_nonfinite = static_cast<int64_t>(table[r].local_nonfinite);
    row.shard_nonfinite = static_cast<int64_t>(table[r].shard_nonfinite);
    row.bad_samples = static_cast<int64_t>(table[r].bad_samples);
    if (r < v.rank_findings.size()) {
      row.grad_norm_z = v.rank_findings[r].grad_norm_z;
      row.loss_z = v.rank_findings[r].loss_z;
      row.reasons = v.rank_findings[r].reasons;
    }
    row.dropped = std::find(v.dropped_ranks.begin(), v.dropped_ranks.end(), static_cast<int>(r)) !=
                  v.dropped_ranks.end();
    rows.push_back(row);
  }
  return rows;
}

std::vector<Event::Replay> replays_of(const Verdict& v) {
  std::vector<Event::Replay> out;
  for (const ReplayResult& r : v.replays)
    out.push_back({r.rank, r.by_rank, r.reproduced, r.loss,
                   norm_of(r.local_nonfinite, r.local_sumsq) / v.loss_scale,
                   static_cast<int64_t>(r.local_nonfinite), r.first_loss,
                   norm_of(r.first_local_nonfinite, r.first_local_sumsq) / v.loss_scale});
  return out;
}

// The samples of one batch whose own loss stands out: nonfinite, or a robust z above `z`. The
// spread is the median absolute deviation, at least 2 % of the median loss: with few finite
// losses (3 of a batch of 4) the deviation is the smaller of two gaps and may be arbitrarily
// small, which would put an ordinary sample 3 % above its batch-mates in quarantine.
std::vector<size_t> outlying_samples(const std::vector<double>& losses, double z) {
  std::vector<double> finite;
  for (double l : losses)
    if (std::isfinite(l)) finite.push_back(l);
  auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x.empty() ? 0.0 : x[x.size() / 2];
  };
  const double m = median(finite);
  std::vector<double> dev;
  for (double l : finite) dev.push_back(std::abs(l - m));
  const double spread = std::max(1.4826 * median(dev), 0.02 * std::abs(m));
  std::vector<size_t> out;
  for (size_t i = 0; i < losses.size(); ++i)
    if (!std::isfinite(losses[i]) || (finite.size() >= 3 && losses[i] > m + z * spread))
      out.push_back(i);
  return out;
}

}  // namespace

void check_sample_table(const SampleTable& t) {
  for (size_t r = 0; r < t.ids.size() || r < t.losses.size(); ++r) {
    const size_t ids = r < t.ids.size() ? t.ids[r].size() : 0;
    const size_t losses = r < t.losses.size() ? t.losses[r].size() : 0;
    if (ids != losses)
      throw InputError(fmt::format("rank {} gave {} sample ids and {} sample losses; give one id "
                                   "per sample loss (sample_ids and sample_losses of the same "
                                   "batch, in the same order)",
                                   r, ids, losses));
  }
}

SampleEvidence judge_samples(const Verdict& v, const SampleTable& t, double zscore) {
  SampleEvidence out;
  check_sample_table(t);  // every index below is in range
  if (v.scope == core::kGlobal) return out;  // the model, not a batch
  const bool data = v.cause.find(kCauseData) != std::string::npos;
  for (int r : v.culprit_ranks) {
    if (r < 0 || static_cast<size_t>(r) >= t.ids.size()) continue;  // no samples given
    const std::vector<double>& losses = t.losses[r];
    if (losses.size() > 1 && std::none_of(losses.begin(), losses.end(),
                                          [](double l) { return std::isfinite(l); }))
      continue;  // every sample of its batch nonfinite: the model or the rank, not a sample
    const std::vector<size_t> bad = outlying_samples(losses, zscore > 0 ? zscore : 6.0);
    for (size_t i : bad) out.quarantine.push_back(t.ids[r][i]);
    if (bad.empty() && data)
      out.suspect.insert(out.suspect.end(), t.ids[r].begin(), t.ids[r].end());
  }
  return out;
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
                     std::vector<NamedTensor> grads, std::string host, std::string device,
                     std::string loop, std::vector<std::string> places)
    : thresholds_(thresholds),
      top_params_(top_params),
      rank_(rank),
      grads_(std::move(grads)),
      host_(std::move(host)),
      device_(std::move(device)),
      loop_(std::move(loop)),
      places_(std::move(places)) {}

Event Explainer::event(const RunCounters& after, const RankStep& mine, const Verdict& v,
                       const std::vector<RankStats>& table,
                       const SampleTable& samples, const SkipDetector& detector,
                       double lr) const {
  const bool skip = v.decision == Decision::kSkip && !v.overflow;
  const double scale = v.loss_scale;  // the checks see scaled gradients; events show them unscaled
  Event e;
  e.step = after.step;
  e.decision = v.decision;
  e.scope = v.scope;
  e.cause = v.cause;
  e.reasons = v.reasons;
  e.why = v.why;
  e.guard = v.guard;
  e.global = {v.grad_norm,   v.nonfinite, v.loss,  v.overflow_runs,
              v.grad_norm_z, v.loss_z,    scale, v.clip_to};
  const WindowSummary w = detector.window();
  e.window = {w.history, w.grad_norm_mean, w.grad_norm_std, w.loss_mean, w.loss_std};
  e.thresholds = {thresholds_.max_grad_norm, thresholds_.grad_norm_zscore,
                  thresholds_.loss_zscore, thresholds_.min_history};
  e.rank = rank_;
  e.loop = loop_;
  const GradCheckStats& own = mine.local_checked ? mine.local : mine.shard;
  e.local = {mine.loss,
             mine.local_checked ? norm_of(own.nonfinite, own.sumsq) / scale : Event::kNaN,
             mine.local_checked ? std::sqrt(own.sumsq) / scale : Event::kNaN,
             static_cast<int64_t>(mine.local.nonfinite),
             fault_name(mine.fault),
             mine.sample_ids,
             mine.sample_losses,
             mine.local_checked ? "local" : "shard",
             top_params(grads_, own, top_params_, scale),
             host_,
             device_};
  e.ranks = rank_rows(table, v, places_);
  if (static_cast<size_t>(rank_) < places_.size()) e.local.place = places_[rank_];
  // With no check of each rank's own gradient (FSDP2, or diagnostics.local_check off) the ranks'
  // gradients were mixed before any check: a global verdict no rank's own values explain says
  // nothing of the cause.
  if (!mine.local_checked && e.scope == core::kGlobal && elevated_ranks(e) == 0) e.cause = "";
  e.culprit_ranks = v.culprit_ranks;
  SampleEvidence evidence = judge_samples(v, samples, thresholds_.loss_zscore);
  e.quarantine_sample_ids = std::move(evidence.quarantine);
  e.suspect_sample_ids = std::move(evidence.suspect);
  e.replays = replays_of(v);
  e.hardware_suspects = v.hardware_suspects;
  e.dropped_ranks = v.dropped_ranks;
  e.moments_reset = v.moments_reset;
  e.lr = lr;
  e.counters = after;
  e.consecutive_skips = skip ? detector.consecutive_skips() + 1
                        : v.updates() ? 0
                                      : detector.consecutive_skips();
  return e;
}

namespace {

// "local: culprit rank 1 (cause data)" / "global: most ranks' own values elevated (instability,
// not data)".
std::string scope_text(const Event& e) {
  if (e.why == core::kNonfiniteParameters)
    return "the model: its own parameters are nonfinite (no rank's batch, no sample to blame)";
  if (e.scope == core::kGlobal) {
    const int64_t elevated = elevated_ranks(e);
    if (elevated == 0 && e.local.top_params_scope != "local")
      return "global: no rank can be named (the ranks' gradients were combined before the check, "
             "and no rank's own loss stands out)";
    return fmt::format("global: {} (instability, not data)",
                       elevated > 0 ? fmt::format("{} of {} ranks' own values elevated", elevated,
                                                  e.ranks.size())
                                    : std::string("no rank stands out alone"));
  }
  std::string out = (e.scope == core::kNoScope ? "" : std::string(scope_name(e.scope)) + ": ") +
                    culprits_text(e);
  if (!e.cause.empty()) out += " (cause " + e.cause + ")";
  if (!e.hardware_suspects.empty())
    out += fmt::format("; device of rank {} suspect, see `lockstep diag`",
                       fmt::join(e.hardware_suspects, ", "));
  return out;
}

// A transient fault's numbers: "rank 0's first computation grad norm 2.1e+36, its replay 0.81".
std::string replayed_text(const Event& e) {
  std::vector<std::string> parts;
  for (const Event::Replay& r : e.replays)
    if (r.rank == r.by_rank && !r.reproduced)
      parts.push_back(fmt::format("rank {}'s first computation: grad norm {:.4g}, loss {:.4g}; "
                                  "its replay: {:.4g}, {:.4g}",
                                  r.rank, r.first_grad_norm, r.first_loss, r.grad_norm, r.loss));
  return parts.empty() ? "replayed" : fmt::format("{}", fmt::join(parts, "; "));
}

// "bad samples [3015]", "suspect batch [...] (...)", both, or "no sample stands out".
std::string samples_text(const Event& e) {
  std::vector<std::string> parts;
  if (!e.quarantine_sample_ids.empty())
    parts.push_back("bad samples " + brief_ids(e.quarantine_sample_ids));
  if (!e.suspect_sample_ids.empty())
    parts.push_back(fmt::format("suspect batch {} (no sample stands out: not quarantined)",
                                brief_ids(e.suspect_sample_ids)));
  return parts.empty() ? "no sample stands out" : fmt::format("{}", fmt::join(parts, "; "));
}

std::string numbers_text(const Event& e) {
  return fmt::format("grad_norm {:.4g}, {} nonfinite, loss {:.4g}", e.global.grad_norm,
                     static_cast<int64_t>(e.global.nonfinite), e.global.loss);
}

// A setting as the loop that wrote the event takes it: "skip.enabled = true" for lockstep's
// trainer, "skip_enabled=True" for the guard's keywords.
std::string setting(const Event& e, const std::string& key, const std::string& value) {
  if (e.loop != "pytorch") return key + " = " + value;
  std::string keyword = key;
  keyword[keyword.find('.')] = '_';
  return keyword + "=" + (value == "true" ? "True" : value == "false" ? "False" : value);
}

// How to go past the guard that fired, and what it means.
std::string guard_hint(const Event& e, const std::string& run_dir) {
  const bool pytorch = e.loop == "pytorch";
  const std::string exclude =
      pytorch ? fmt::format("drop the bad samples in your data loader (`lockstep diag {} "
                            "--quarantine FILE` writes their ids)",
                            run_dir)
              : fmt::format("exclude the bad samples with `lockstep diag {}` and "
                            "data.exclude_ids_file",
                            run_dir);
  switch (e.why) {
    case core::kSkipDisabled:
      return exclude + ", or set " + setting(e, "skip.enabled", "true") + " to skip such steps";
    case core::kGlobalSpikeAbort:
      return "most ranks' own values spiked together: the model or optimizer state, not a "
             "batch; lower the learning rate, or set " +
             setting(e, "skip.on_global_spike", "\"clip\"") + " to take such steps clipped";
    case core::kNonfiniteParameters:
      return pytorch ? "the weights themselves are nonfinite (nothing quarantined): check the "
                       "weights you loaded, or resume from a checkpoint saved before they went "
                       "nonfinite"
                     : "the weights themselves are nonfinite (nothing quarantined, nothing "
                       "saved): check checkpoint.initial_load_path's weights, or resume from a "
                       "checkpoint saved before they went nonfinite (checkpoint.load_step)";
    case core::kHardwareFaultAbort:
      return fmt::format("drain the host of rank {} (`lockstep diag {}` lists the suspects) and "
                         "run the same command without it; exit code 5",
                         fmt::join(e.hardware_suspects, ", "), run_dir);
    default: break;
  }
  if (pytorch)
    return exclude + "; to go past this guard, raise its limit, or load the guard's state with " +
           setting(e, "skip.reset_guards_on_resume", "true");
  return exclude + "; to resume past this guard, run the same command with "
                   "--skip.reset_guards_on_resume true (or raise the guard's limit)";
}

// "; AdamW moments of 2 tensors reset (skip.spike_moment_reset): layers.0.attn.wq, ..." or "".
std::string reset_text(const Event& e) {
  if (e.moments_reset.empty()) return "";
  const size_t shown = std::min<size_t>(e.moments_reset.size(), 3);
  return fmt::format("; AdamW moments of {} tensor{} reset (skip.spike_moment_reset): {}{}",
                     e.moments_reset.size(), e.moments_reset.size() > 1 ? "s" : "",
                     fmt::join(e.moments_reset.begin(), e.moments_reset.begin() + shown, ", "),
                     e.moments_reset.size() > shown ? ", ..." : "");
}

}  // namespace

std::string skip_message(const Event& e) {
  if (e.reasons == core::kLossScaleOverflow)
    return fmt::format(
        "step {}: SKIP (loss_scale_overflow) | {} nonfinite gradient elements at loss scale {:g}, "
        "every loss finite: an fp16 overflow, not bad data; the scale backs off | weights and "
        "optimizer state untouched; {} overflow skips",
        e.step, static_cast<int64_t>(e.global.nonfinite), e.global.loss_scale,
        e.counters.overflow_skips);
  if (e.decision == Decision::kClip)
    return fmt::format(
        "step {}: CLIP ({}) | {} | {} | the step is taken clipped to grad norm {:.4g}{}; "
        "nothing quarantined; clipped {} of {}",
        e.step, fmt::join(reason_names(e.reasons), ", "), numbers_text(e), scope_text(e), e.global.clip_to,
        reset_text(e), e.counters.clipped_steps, e.step);
  if (e.decision == Decision::kSalvage)
    return fmt::format(
        "step {}: SALVAGE ({}) | {} | rank{} {} contributed nothing, the other ranks stepped "
        "(mean over their tokens) | {} | salvaged {} of {}, {} contributions dropped",
        e.step, fmt::join(reason_names(e.reasons), ", "), scope_text(e), e.dropped_ranks.size() > 1 ? "s" : "",
        fmt::join(e.dropped_ranks, ", "), samples_text(e),
        e.counters.salvaged_steps, e.step, e.counters.dropped_contributions);
  if (e.decision == Decision::kStep)
    return fmt::format(
        "step {}: STEP after replay ({}) | {} | {} | the replayed gradient was synced; the step "
        "is taken",
        e.step, fmt::join(reason_names(e.reasons), ", "), scope_text(e), replayed_text(e));
  return fmt::format(
      "step {}: SKIP ({}) | {} | {} | {} | {}; skipped {} of {}", e.step,
      fmt::join(reason_names(e.reasons), ", "), numbers_text(e), scope_text(e), samples_text(e),
      e.moments_reset.empty() ? "weights and optimizer state untouched"
                              : "weights untouched" + reset_text(e),
      e.counters.skipped_steps, e.step);
}

std::string abort_message(const Event& e, const std::string& saved, const std::string& run_dir) {
  if (e.reasons == core::kLossScaleOverflow)
    return fmt::format(
        "step {}: aborted on loss_scale_overflow ({}) | {} nonfinite gradient elements at loss "
        "scale {:g} with every loss finite, {} overflow skips in all | {}; the fp16 gradients "
        "keep overflowing: look at the loss and grad_norm before this step (instability), or "
        "train in bfloat16 (training.mixed_precision_param)",
        e.step, e.guard, static_cast<int64_t>(e.global.nonfinite), e.global.loss_scale,
        e.counters.overflow_skips, saved);
  return fmt::format("step {}: aborted on {} ({}) | {} | {} | {} | {}; details in "
                     "{}/diagnostics; {}",
                     e.step, fmt::join(reason_names(e.reasons), ", "), e.guard, numbers_text(e), scope_text(e),
                     samples_text(e), saved, run_dir, guard_hint(e, run_dir));
}

}  // namespace lockstep
