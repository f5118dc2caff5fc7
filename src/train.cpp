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
// With the decision on the device (skip.device_decision) the step splits in two: issue runs
// the same data flow up to the update with the table and the decision left on the device (no
// host sync on a clean step), and finish, a step later, reads the copied table, takes the same
// decision on the host (explain, counters, progress) and checks the device agreed.
//
// job.cpp builds every component from the config; each component owns its algorithm.
#include "lockstep/train.h"

#include <fmt/format.h>

#include <optional>

#include "clock.h"
#include "compute.h"
#include "decide/device_decision.h"
#include "diag/metrics.h"
#include "job.h"
#include "lockstep/error.h"
#include "log.h"
#include "outcome.h"
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

// This rank's batch of 1-based `step`, forward and backward, then [A] its own gradient.
RankStep compute(Job& job, int64_t step) {
  RankStep s;
  s.fault = job.faults->begin_step(step);
  forward_backward(job, s, step);
  const auto start = Clock::now();
  check_local(job, s);  // [A]
  s.costs.decision = seconds_since(start);
  return s;
}

// The gradient sync (a rank the triage dropped contributes zeros), [B] the slice this rank
// checks, and this rank's 64-byte row of stats, built on the device.
at::Tensor sync_and_row(Job& job, RankStep& s, const Triage& t) {
  const auto start = Clock::now();
  const bool dropped =
      std::find(t.dropped.begin(), t.dropped.end(), job.ranks.rank) != t.dropped.end();
  if (dropped) job.dp->zero_grad();
  // all-reduce (ddp) or reduce-scatter (sharded) of the flat buffer
  job.dp->sync_gradients(job.ranks.world_size - static_cast<int>(t.dropped.size()));
  s.costs.sync = seconds_since(start);
  s.shard_stats = job.shard_check->run().clone();  // [B]; its buffer is reused next step
  s.shard_read = false;
  return rank_row(s.local_stats, s.shard_stats, s.loss_t, s.sample_losses_t,
                  StopSignals::received() != 0);
}

// Then the one small collective: every rank holds every rank's stats, in rank order (the
// table is the host-decided step's one read on the host).
std::vector<RankStats> measure(Job& job, RankStep& s, const Triage& t) {
  const at::Tensor row = sync_and_row(job, s, t);
  const auto start = Clock::now();
  std::vector<RankStats> table = exchange_stats(row, job.comm.get());
  s.costs.decision += seconds_since(start);
  return table;
}

// The update (sharded: then the all-gather of the blocks); a skip reaches the fused AdamW as
// found_inf = 1: parameters, moments and step counts stay bitwise as they were.
void update(Job& job, double lr, const UpdateControl& control) {
  job.dp->apply(lr, control);
  job.dp->zero_grad();
  job.faults->after_update(job.model->parameters());
}

// The clip of a taken step: the agreed norm against training.max_norm (or a clip decision's
// lower bound); the loss scale is divided out in the same pass (grad_scale = scale / clip).
double clip_of(const Job& job, const Verdict& v) {
  if (v.decision == Decision::kSkip) return 1.0;
  return clip_coefficient(v.grad_norm,
                          kernels::clip_limit(v.clip_to, job.config.training.max_norm));
}

// One step, 1-based `step`, at learning rate `lr`, decided on the host.
StepResult step(Job& job, int64_t step, double lr) {
  RankStep s = compute(job, step);
  const Recompute replay = replayer(job, s, step);
  Triage triage =
      job.triager->before_sync(*job.detector, triage_input(job, s, step), replay, s.costs);
  const std::vector<RankStats> table = measure(job, s, triage);
  job.triager->probe(step, table, triage_input(job, s, step), replay, triage, s.costs);
  const auto start = Clock::now();
  StepResult r{job.detector->decide(table, *job.scaler, triage), lr};
  s.costs.decision += seconds_since(start);
  r.costs = s.costs;
  const Verdict& v = r.verdict;
  warn_overflow(step, v);
  if (v.anomalous()) explain(job, s, v, table, lr);
  r.clip = clip_of(job, v);
  update(job, lr, {v.decision == Decision::kSkip, r.clip, v.loss_scale});
  advance(job, v, job.sampler->position());
  return r;
}

// A step decided on the device, between its issue and its finish.
struct Issued {
  int64_t step = 0;
  double lr = 0;
  RankStep s;
  int64_t data_position = 0;
};

// The step up to its update, decided on the device: nothing waits for the host.
Issued issue(Job& job, int64_t step, double lr) {
  Issued i{step, lr, compute(job, step), 0};
  const at::Tensor row = sync_and_row(job, i.s, {});
  const auto decided = Clock::now();
  const DeviceDecision::Update u = job.decision->decide(gather_rows(job.comm.get(), row), step);
  i.s.costs.decision += seconds_since(decided);
  update(job, lr, UpdateControl::on_device(u.found_inf, u.grad_scale));
  i.data_position = job.sampler->position();
  return i;
}

// The issued step's verdict, a step later: the host takes the same decision from the copied
// table (the device's windows are the host's, bit for bit) and checks the device agreed.
StepResult finish(Job& job, Issued& i) {
  const auto start = Clock::now();
  const DeviceDecision::Late late = job.decision->read(i.step);
  StepResult r{job.detector->decide(late.table, *job.scaler), i.lr};
  i.s.costs.decision += seconds_since(start);
  r.costs = i.s.costs;
  const Verdict& v = r.verdict;
  r.clip = clip_of(job, v);
  expect_same_decision(i.step, v, r.clip, late);
  warn_overflow(i.step, v);
  if (v.anomalous()) explain(job, i.s, v, late.table, i.lr);
  advance(job, v, i.data_position);
  return r;
}

// One host-decided step, its host syncs watched from the third step of this process on.
StepResult watched_step(Job& job, int64_t first_step, double lr) {
  const SyncWatch watch(job.state.step >= first_step + 2);
  return step(job, job.state.step + 1, lr);
}

// The device loop: step n is issued, then the step before it finished. A step whose state the
// host needs before the next update (a log, checkpoint, validation or verify step, the last,
// or the one after a stop request) is finished at once.
void run_on_device(Job& job, Progress& progress, TrainResult& result, int64_t& last_verified) {
  const Config& c = job.config;
  const int64_t first = job.state.step;
  std::optional<Issued> late;
  bool stopping = false;
  for (int64_t n = first + 1; n <= c.training.steps; ++n) {
    const bool now = stopping || host_needs_step(job, n);
    std::optional<SyncWatch> watch;
    if (n >= first + 3 && !now) watch.emplace(true);
    Issued issued = issue(job, n, next_lr(job.schedule, n - 1, 0));
    if (late)
      stopping = after_step(job, progress, result, finish(job, *late), last_verified, false);
    late.reset();
    watch.reset();
    if (now || stopping) after_step(job, progress, result, finish(job, issued), last_verified);
    else late.emplace(std::move(issued));
  }
}

// The loop: step, progress, validate, verify, save, stop.
void run(Job& job, Progress& progress, TrainResult& result) {
  const Config& c = job.config;
  const StopSignals signals;
  int64_t last_verified = job.state.step;  // the last step all ranks were seen to agree
  if (job.decision) return run_on_device(job, progress, result, last_verified);
  const int64_t first_step = job.state.step;
  while (job.state.step < c.training.steps) {
    const double lr = next_lr(job.schedule, job.state.step, job.state.optimizer_steps);
    after_step(job, progress, result, watched_step(job, first_step, lr), last_verified);
  }
}

TrainResult train_job(Job& job) {
  TrainResult result;
  result.start_step = job.state.step;
  if (decides_on_device(job.config, job.device))
    job.decision = std::make_unique<DeviceDecision>(job.config, job.device, job.ranks.world_size,
                                                    *job.detector, *job.scaler, job.state);
  Progress progress({job.lead ? job.run_dir + "/metrics.jsonl" : "", job.config.training.steps,
                     job.tokens_per_step, job.config.metrics.log_freq, job.scaler->enabled(),
                     job.model->flops_per_token(job.config.training.seq_len), job.peak_flops,
                     job.ranks.world_size});
  run(job, progress, result);
  finish_run(job, progress, result);
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
