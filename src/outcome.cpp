#include "outcome.h"

#include <fmt/format.h>

#include <csignal>

#include "diag/verify.h"
#include "lockstep/error.h"
#include "log.h"
#include "runtime.h"

namespace lockstep {

Event explain(Job& job, const RankStep& s, const Verdict& v, const std::vector<RankStats>& table,
              const SampleTable& samples, double lr, int64_t data_position) {
  const Event e =
      job.judge->explain(job.state, s, v, table, samples, lr, job.tokens_per_step, data_position);
  if (v.decision != Decision::kAbort)
    log::write_shared(skip_message(e));
  return e;
}

void judge_model(Job& job, Verdict& v) {
  if (!model_suspect(v)) return;
  const auto mine = nonfinite_tensors(job.dp->held_parameters());
  double count = 0;
  for (const auto& [name, n] : mine) count += static_cast<double>(n);
  std::vector<double> counts;
  for (const auto& row : all_gather_values(job.comm.get(), {count})) counts.push_back(row.at(0));
  blame_model(v, counts, mine);
}

void abort_run(Job& job, const Event& e, const Verdict& v) {
  log::flush();
  std::string saved = "no checkpoint (checkpoint.enable = false)";
  if (v.why == core::kNonfiniteParameters)  // its parameters went wrong: nothing to keep
    saved = "nothing saved (the parameters are nonfinite)";
  else if (job.config.checkpoint.enable && job.state.step > 0)
    saved = "last good state saved in " + save_checkpoint(job);
  throw TrainingAborted(abort_message(e, saved, job.run_dir),
                        v.why == core::kHardwareFaultAbort ? ExitCode::kHardwareFault
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
                          !job.config.checkpoint.enable
                              ? " (checkpoint.enable = false: nothing saved)"
                          : job.state.step == 0
                              ? " (no step completed: nothing saved)"
                              : "; checkpoint saved in " +
                                    job.checkpointer->dir_of(job.state.step)));
}

void verify(Job& job, int64_t& last_verified) {
  const ReplicaVote vote = vote_replicas(job.dp->replicated_parameters(),
                                         job.dp->replicated_optimizer_state(), job.comm.get());
  if (vote.diverged.empty()) {
    last_verified = job.state.step;
    return;
  }
  job.judge->write_event(to_json(
      desync_event(job.state.step, job.ranks.rank, job.faults->current(), vote, job.suspects)));
  log::flush();
  throw TrainingAborted(desync_message(job.state.step, last_verified, vote, job.suspects));
}

void validate(Job& job, Progress& progress) {
  const ValidationResult v =
      job.validator->run(*job.model, job.comm.get(), job.dp->collective_forward());
  progress.validation_done(job.state.step, v.loss, v.perplexity, v.samples, v.seconds);
}

void count_step(Job& job, const Verdict& v, int64_t data_position) {
  if (v.interrupted) return;  // the step did not happen: no window, guard or counter moves
  for (int r : v.hardware_suspects) job.suspects[r].push_back(job.state.step + 1);
  job.judge->record(job.state, v, job.tokens_per_step, data_position);
}

void warn_overflow(int64_t step, const Verdict& v) {
  if (v.overflow_runs > 0 && v.nonfinite == 0)
    log::warn_shared("step {}: gradient squares overflow fp32 (grad_norm {:.4g}); summed in fp64",
                     step, v.grad_norm);
}

AfterStep work_after(const Job& job, int64_t n) {
  const Config& c = job.config;
  const int64_t every = c.diagnostics.verify_every;
  AfterStep a;
  a.last = n == c.training.steps;
  a.log = n % c.metrics.log_freq == 0 || a.last;
  a.validate = job.validator && job.validator->due(n);
  a.verify = job.comm && every > 0 && (n % every == 0 || a.last);
  a.save = c.checkpoint.enable && (n % c.checkpoint.interval == 0 || a.last);
  return a;
}

bool after_step(Job& job, Progress& progress, TrainResult& result, const StepResult& r,
                int64_t& last_verified, bool may_stop) {
  if (r.verdict.interrupted) {  // every rank saw it in the same table: all stop here
    log::warn_shared("a stop signal cut step {} short: nothing of it lands; the run stops at "
                     "step {}",
                     job.state.step + 1, job.state.step);
    // The last completed step's checkpoint exists when this process resumed from it or saved it.
    const int64_t at = job.state.step;
    stop(job, at == 0 || at == result.start_step || work_after(job, at).save);
  }
  const AfterStep a = work_after(job, job.state.step);
  result.losses.push_back(r.verdict.loss);
  job.stragglers->add(r.compute_seconds, r.all_measured);
  if (a.log) job.stragglers->evaluate(job.comm.get());  // every rank's median, one number each
  if (a.log && job.stragglers->newly_named())
    log::warn_shared("step {}: straggler {}: its compute takes that many times the other "
                     "ranks' (medians over the last {} steps), and every step waits for it; "
                     "look at its host (diagnostics.straggler_factor sets the threshold)",
                     job.state.step, StragglerWatch::text(job.stragglers->slow()),
                     job.config.diagnostics.straggler_window);
  progress.step_done(job.state, r.verdict, job.judge->detector(), r.lr, r.clip, r.costs,
                     job.stragglers->slow(), a.log);
  if (a.validate) validate(job, progress);
  if (a.verify) verify(job, last_verified);
  if (a.save) save_checkpoint(job);
  if (r.verdict.stop && !a.last && may_stop) stop(job, a.save);
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
              fmt::format("{:08x}", job.dp->parameters_crc32()));
  else
    log::info("nothing to do: the run is already at step {} of {}", job.state.step,
              job.config.training.steps);
  log::flush();
}

}  // namespace lockstep
