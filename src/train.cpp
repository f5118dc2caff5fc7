// The training loop and the step, nothing else. The step reads like the data flow it runs:
//
//   forward/backward over the micro-batches, then [A] this rank's own gradient
//   -> triage (skip.scope = "rank", skip.replay): local outliers, replays, ranks to drop
//   -> measure: the gradient sync, [B] the slice it checks, one small all-gather of every
//               rank's 64-byte stats; the probe (diagnostics.replay_every)
//   -> decide: STEP, SKIP, CLIP, SALVAGE or ABORT, the same on every rank by construction
//   -> explain: only when anomalous (events, scope and cause, culprits, samples, parameters)
//   -> apply: fused AdamW with found_inf (a skip) and grad_scale (the clip), counters
//
// job.cpp builds every component from the config; each component owns its algorithm.
#include "lockstep/train.h"

#include <fmt/format.h>

#include <csignal>

#include "clock.h"
#include "compute.h"
#include "diag/metrics.h"
#include "diag/verify.h"
#include "job.h"
#include "lockstep/error.h"
#include "log.h"
#include "runtime.h"

namespace lockstep {
namespace {

// What the triage and the probe read of this rank's step (on the host: only when they run).
TriageInput triage_input(const Job& job, RankStep& s, int64_t step) {
  if (!job.triager->needs_input(step)) return {};
  read_to_host(s);
  return {rank_stats(s.local, {}, s.loss, s.sample_losses, false), s.sample_ids, s.sample_losses,
          job.scaler->scale()};
}

// The gradient sync (a rank the triage dropped contributes zeros), [B] the slice this rank
// checks, then the one small collective: every rank holds every rank's stats, in rank order.
std::vector<RankStats> measure(Job& job, RankStep& s, const Triage& t) {
  const auto start = Clock::now();
  const bool dropped =
      std::find(t.dropped.begin(), t.dropped.end(), job.ranks.rank) != t.dropped.end();
  if (dropped) job.dp->zero_grad();
  // all-reduce (ddp) or reduce-scatter (sharded) of the flat buffer
  job.dp->sync_gradients(job.ranks.world_size - static_cast<int>(t.dropped.size()));
  const auto synced = Clock::now();
  s.costs.sync = std::chrono::duration<double>(synced - start).count();
  s.shard_stats = job.shard_check->run().clone();  // [B]; its buffer is reused next step
  s.shard_read = false;
  // This rank's row, built on the device; the table is the step's one read on the host.
  const at::Tensor row = rank_row(s.local_stats, s.shard_stats, s.loss_t, s.sample_losses_t,
                                  StopSignals::received() != 0);
  std::vector<RankStats> table = exchange_stats(row, job.comm.get());
  s.costs.decision += seconds_since(synced);
  return table;
}

// Every rank writes its event (its own view plus the agreed table). A skip is logged; an abort
// keeps the last good state (the weights are still it) and stops every rank alike.
void explain(Job& job, RankStep& s, const Verdict& v, const std::vector<RankStats>& table,
             double lr) {
  read_to_host(s);
  const SampleTable samples = exchange_samples(s.sample_ids, s.sample_losses, job.comm.get());
  const Event e =
      job.explainer->event(job.state.step + 1, job.state, s, v, table, samples, *job.detector, lr);
  job.events->write(to_json(e));
  if (v.decision != Decision::kAbort) {
    log::write(job.lead ? log::Level::kWarn : log::Level::kInfo, skip_message(e));
    return;
  }
  log::flush();
  std::string saved = "no checkpoint (checkpoint.enable = false)";
  if (job.config.checkpoint.enable && job.state.step > 0)
    saved = "last good state saved in " + save_checkpoint(job);
  throw TrainingAborted(abort_message(e, saved, job.run_dir),
                        v.guard == "skip.on_hardware_fault = abort" ? ExitCode::kHardwareFault
                                                                    : ExitCode::kTrainingAborted);
}

// The update and the counters. A skip reaches the fused AdamW as found_inf = 1: parameters,
// moments and step counts stay bitwise as they were. Clipping reuses the agreed norm, and the
// loss scale is divided out in the same pass (grad_scale = scale / clip).
double apply(Job& job, const Verdict& v, double lr) {
  const bool skip = v.decision == Decision::kSkip;
  const double max_norm = job.config.training.max_norm;  // a clip decision may lower it
  const double limit = v.clip_to > 0 && (max_norm <= 0 || v.clip_to < max_norm) ? v.clip_to
                                                                                 : max_norm;
  const double clip = skip ? 1.0 : clip_coefficient(v.grad_norm, limit);
  job.dp->apply(lr, {skip, clip, v.loss_scale});  // sharded: then all-gather the blocks
  job.dp->zero_grad();
  job.detector->record(v);
  job.scaler->record(v.overflow, !skip);  // the same verdict everywhere: the same scale
  job.faults->after_update(job.model->parameters());
  for (int r : v.hardware_suspects) job.suspects[r].push_back(job.state.step + 1);
  TrainState& st = job.state;
  st.step += 1;
  st.optimizer_steps += skip ? 0 : 1;
  st.skipped_steps += skip && !v.overflow ? 1 : 0;
  st.overflow_skips += v.overflow ? 1 : 0;
  count_outcome(st, v);
  st.data_position = job.sampler->position();
  st.tokens_seen += job.tokens_per_step;
  return clip;
}

struct StepResult {
  Verdict verdict;
  double clip = 1.0;
  StepCosts costs;
};

// One step, 1-based `step`, at learning rate `lr`.
StepResult step(Job& job, int64_t step, double lr) {
  RankStep s;
  s.fault = job.faults->begin_step(step);
  forward_backward(job, s, step);
  auto start = Clock::now();
  check_local(job, s);  // [A]
  s.costs.decision = seconds_since(start);
  const Recompute replay = replayer(job, s, step);
  Triage triage =
      job.triager->before_sync(*job.detector, triage_input(job, s, step), replay, s.costs);
  const std::vector<RankStats> table = measure(job, s, triage);
  job.triager->probe(step, table, triage_input(job, s, step), replay, triage, s.costs);
  start = Clock::now();
  StepResult r{job.detector->decide(table, *job.scaler, triage)};
  s.costs.decision += seconds_since(start);
  r.costs = s.costs;
  const Verdict& v = r.verdict;
  if (v.overflow_runs > 0 && v.nonfinite == 0)
    log::warn("step {}: gradient squares overflow fp32 (grad_norm {:.4g}); summed in fp64", step,
              v.grad_norm);
  if (v.anomalous()) explain(job, s, v, table, lr);
  r.clip = apply(job, v, lr);
  return r;
}

// Every rank saw the same stop request in the same all-gather: all stop after this step.
[[noreturn]] void stop(Job& job, bool saved) {
  if (!saved) save_checkpoint(job);  // nothing with checkpoint.enable = false
  const int seen = StopSignals::received();
  const int sig = seen ? seen : SIGTERM;  // asked by another rank
  log::flush();
  throw Error(static_cast<ExitCode>(128 + sig),
              fmt::format("stopped by {} after step {} of {}{}; run the same command again to "
                          "resume",
                          sig == SIGINT ? "SIGINT" : "SIGTERM", job.state.step,
                          job.config.training.steps,
                          job.config.checkpoint.enable
                              ? "; checkpoint saved in " + job.checkpointer->dir_of(job.state.step)
                              : " (checkpoint.enable = false: nothing saved)"));
}

// Verifies the replicas (diagnostics.verify_every); a desync stops the job naming the ranks.
void verify(Job& job, int64_t& last_verified) {
  const ReplicaVote vote = vote_replicas(job.model->parameters(),
                                         job.dp->replicated_optimizer_state(), job.comm.get());
  if (vote.diverged.empty()) {
    last_verified = job.state.step;
    return;
  }
  job.events->write(to_json(
      desync_event(job.state.step, job.ranks.rank, job.faults->current(), vote, job.suspects)));
  log::flush();
  throw TrainingAborted(desync_message(job.state.step, last_verified, vote, job.suspects));
}

// The held-out loss (every rank evaluates its share).
void validate(Job& job, Progress& progress) {
  const ValidationResult v = job.validator->run(*job.model, job.comm.get());
  progress.validation_done(job.state.step, v.loss, v.perplexity, v.samples, v.seconds);
}

// One step, its host syncs watched from the third step of this process on (SyncWatch).
StepResult watched_step(Job& job, int64_t first_step, double lr) {
  const SyncWatch watch(job.state.step >= first_step + 2);
  return step(job, job.state.step + 1, lr);
}

// The loop: step, progress, validate, verify, save, stop.
void run(Job& job, Progress& progress, TrainResult& result) {
  const Config& c = job.config;
  const StopSignals signals;
  int64_t last_verified = job.state.step;  // the last step all ranks were seen to agree
  const int64_t first_step = job.state.step;
  while (job.state.step < c.training.steps) {
    const double lr = next_lr(job.schedule, job.state.step, job.state.optimizer_steps);
    const StepResult r = watched_step(job, first_step, lr);
    result.losses.push_back(r.verdict.loss);
    progress.step_done(job.state, r.verdict, *job.detector, lr, r.clip, r.costs);
    if (job.validator && job.validator->due(job.state.step)) validate(job, progress);
    const bool last = job.state.step == c.training.steps;
    const int64_t every = c.diagnostics.verify_every;
    if (job.comm && every > 0 && (job.state.step % every == 0 || last)) verify(job, last_verified);
    const bool saved = c.checkpoint.enable && (job.state.step % c.checkpoint.interval == 0 || last);
    if (saved) save_checkpoint(job);
    if (r.verdict.stop && !last) stop(job, saved);
  }
}

TrainResult train_job(Job& job) {
  TrainResult result;
  result.start_step = job.state.step;
  Progress progress({job.lead ? job.run_dir + "/metrics.jsonl" : "", job.config.training.steps,
                     job.tokens_per_step, job.config.metrics.log_freq, job.scaler->enabled(),
                     job.model->flops_per_token(job.config.training.seq_len), job.peak_flops,
                     job.ranks.world_size});
  run(job, progress, result);
  const double total = progress.elapsed();
  const int64_t ran = job.state.step - result.start_step;
  result.final_step = job.state.step;
  result.optimizer_steps = job.state.optimizer_steps;
  result.skipped_steps = job.state.skipped_steps;
  result.tokens_per_second = ran > 0 ? static_cast<double>(ran * job.tokens_per_step) / total : 0;
  if (ran > 0)
    log::info("done: {} steps in {:.1f} s, {:.0f} tok/s, final loss {:.4f}, {} skipped, peak "
              "resident memory {:.0f} MiB, parameters crc32 {}",
              ran, total, result.tokens_per_second, result.losses.back(),
              job.state.skipped_steps, peak_resident_mib(),
              tensors_crc32(job.model->parameters()));
  else
    log::info("nothing to do: the run is already at step {} of {}", job.state.step,
              job.config.training.steps);
  log::flush();
  return result;
}

}  // namespace

TrainResult train(const Config& config) {
  try {
    const std::unique_ptr<Job> job = build_job(config);
    resume(*job);
    return train_job(*job);
  } catch (const std::exception& e) {  // the rank's log file says how the run ended, too
    log::write_file_only(log::Level::kError, e.what());
    throw;
  }
}

}  // namespace lockstep
