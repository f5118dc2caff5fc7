#include "outcome.h"

#include <fmt/format.h>

#include <csignal>

#include "diag/verify.h"
#include "lockstep/error.h"
#include "log.h"
#include "runtime.h"

namespace lockstep {

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

void validate(Job& job, Progress& progress) {
  const ValidationResult v = job.validator->run(*job.model, job.comm.get());
  progress.validation_done(job.state.step, v.loss, v.perplexity, v.samples, v.seconds);
}

void advance(Job& job, const Verdict& v, int64_t data_position) {
  const bool skip = v.decision == Decision::kSkip;
  job.detector->record(v);
  job.scaler->record(v.overflow, !skip);  // the same verdict everywhere: the same scale
  for (int r : v.hardware_suspects) job.suspects[r].push_back(job.state.step + 1);
  TrainState& st = job.state;
  st.step += 1;
  st.optimizer_steps += skip ? 0 : 1;
  st.skipped_steps += skip && !v.overflow ? 1 : 0;
  st.overflow_skips += v.overflow ? 1 : 0;
  count_outcome(st, v);
  st.data_position = data_position;
  st.tokens_seen += job.tokens_per_step;
}

void warn_overflow(int64_t step, const Verdict& v) {
  if (v.overflow_runs > 0 && v.nonfinite == 0)
    log::warn("step {}: gradient squares overflow fp32 (grad_norm {:.4g}); summed in fp64", step,
              v.grad_norm);
}

bool host_needs_step(const Job& job, int64_t n) {
  const Config& c = job.config;
  const int64_t every = c.diagnostics.verify_every;
  return n == c.training.steps || n % c.metrics.log_freq == 0 ||
         (c.checkpoint.enable && n % c.checkpoint.interval == 0) ||
         (job.validator && job.validator->due(n)) || (job.comm && every > 0 && n % every == 0);
}

bool after_step(Job& job, Progress& progress, TrainResult& result, const StepResult& r,
                int64_t& last_verified, bool may_stop) {
  const Config& c = job.config;
  result.losses.push_back(r.verdict.loss);
  progress.step_done(job.state, r.verdict, *job.detector, r.lr, r.clip, r.costs);
  if (job.validator && job.validator->due(job.state.step)) validate(job, progress);
  const bool last = job.state.step == c.training.steps;
  const int64_t every = c.diagnostics.verify_every;
  if (job.comm && every > 0 && (job.state.step % every == 0 || last)) verify(job, last_verified);
  const bool saved = c.checkpoint.enable && (job.state.step % c.checkpoint.interval == 0 || last);
  if (saved) save_checkpoint(job);
  if (r.verdict.stop && !last && may_stop) stop(job, saved);
  return r.verdict.stop;
}

void finish_run(Job& job, const Progress& progress, TrainResult& result) {
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
}

}  // namespace lockstep
