// The training loop and the step, nothing else. The step reads like the data flow it runs:
//
//   forward/backward over the micro-batches, then [A] this rank's own gradient
//   -> triage (skip.scope = "rank", skip.replay): local outliers, replays, ranks to drop
//   -> measure: the gradient sync, [B] the slice it checks, one small exchange: a fixed-size
//               record (skip.exchange), or every rank's 72-byte stats; the probe's replay
//   -> decide: STEP, SKIP, CLIP, SALVAGE or ABORT, the same on every rank by construction;
//              then per tensor (AdaGC's clip, SPAM's moment reset: decide/tensor_policies.h)
//   -> explain: only when anomalous (events, scope and cause, culprits, samples, parameters)
//   -> apply: fused AdamW with found_inf (a skip) and grad_scale (the clip), counters
//
// A step is issued (up to its update), then finished (its counters, progress, checkpoints) with
// a lag: at once when the host decides (lag 0), or a step later when the device decides
// (skip.device_decision, lag 1: a clean step never waits for the host; finish reads the copied
// table, and the judge decides the same on the host and checks the device agreed). A step whose
// state the host needs (work_after) is finished at once either way.
//
// job.cpp builds every component from the config; each component owns its algorithm.
#include "lockstep/train.h"

#include <fmt/format.h>

#include <optional>

#include "clock.h"
#include "compute.h"
#include "decide/record.h"
#include "diag/metrics.h"
#include "job.h"
#include "lockstep/error.h"
#include "log.h"
#include "outcome.h"
#include "runtime.h"

namespace lockstep {
namespace {

// This rank's batch of 1-based `step`, forward and backward, then [A] its own gradient.
RankStep compute(Job& job, int64_t step) {
  RankStep s;
  job.compute_clock->begin();
  s.fault = job.faults->begin_step(step);
  forward_backward(job, s, step);
  const auto start = Clock::now();
  check_local(job, s);  // [A]
  s.costs.decision = seconds_since(start);
  job.compute_clock->end();
  return s;
}

// The gradient sync (a rank the triage dropped contributes zeros), [B] the slice this rank
// checks, and this rank's 72-byte row of stats, built on the device.
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
                  s.interrupted ? 2.0 : StopSignals::received() != 0 ? 1.0 : 0.0,
                  job.compute_clock->seconds());
}

// Then the one small exchange: a fixed-size record (skip.exchange; every rank's row only on a
// step to explain) or every rank's 72-byte row (the table). On a GPU the read waits for the step.
struct Measured {
  std::vector<RankStats> table;
  std::optional<Verdict> record;  // the record form's verdict
  double seconds = 0;             // this rank's compute; did every rank measure its?
  bool all_measured = false;
};
Measured measure(Job& job, RankStep& s, const Triage& t) {
  const at::Tensor row = sync_and_row(job, s, t);
  const auto start = Clock::now();
  const bool record = job.judge->detector().own_only();
  const at::Tensor read = record ? row.cpu() : gather_rows(job.comm.get(), row).cpu();
  if (row.is_cuda()) s.costs.wait += seconds_since(start), s.costs.waits += 1;
  const std::vector<RankStats> rows = stats_of(read.reshape({-1, kRankStatsDoubles}));
  const RankStats mine = rows.at(record ? 0 : static_cast<size_t>(job.ranks.rank));
  Measured m{rows, std::nullopt, mine.compute_seconds, all_measured(rows)};
  if (record) {
    RecordVerdict v = decide_by_record(job.judge->detector(), mine, job.comm.get());
    m = {std::move(v.table), std::move(v.verdict), mine.compute_seconds, v.all_measured};
  }
  s.costs.decision += seconds_since(start);
  return m;
}

// An anomalous step's explanation: a nonfinite one is checked against the model's own
// parameters (judge_model), every rank exchanges its batch's sample ids and writes its event;
// an abort ends the run here, the last good state saved.
void explain_step(Job& job, RankStep& s, Verdict& v, const std::vector<RankStats>& table,
                  double lr, int64_t data_position) {
  if (!v.anomalous() || v.interrupted) return;  // an interrupted step did not happen
  judge_model(job, v);
  read_to_host(s);
  const SampleTable samples = exchange_samples(s.sample_ids, s.sample_losses, job.comm.get());
  const Event e = explain(job, s, v, table, samples, lr, data_position);
  if (v.decision == Decision::kAbort) abort_run(job, e, v);
}

// The per-tensor actions, then the update (sharded: then the all-gather of the blocks); a skip
// reaches the fused AdamW as found_inf = 1: parameters, moments, step counts stay bitwise.
void update(Job& job, double lr, const UpdateControl& control, const TensorActions& tensors) {
  tensors.apply_to(job.dp->optimizer());
  job.dp->apply(lr, control);
  job.dp->zero_grad();
  job.faults->after_update(job.model->parameters());
}

struct Issued {  // a step between its issue and its finish
  int64_t step = 0;
  double lr = 0;
  RankStep s;
  int64_t data_position = 0;
  std::optional<StepResult> decided;  // decided on the host: the verdict, before the update
};

// The step decided on the host (lag 0): triage, measure, decide, explain, then the update.
void decide_on_host(Job& job, Issued& i) {
  RankStep& s = i.s;
  const Recompute replay = replayer(job, s, i.step);
  Triage triage =
      job.triager->before_sync(job.judge->detector(), triage_input(job, s, i.step), replay, s.costs);
  Measured m = measure(job, s, triage);
  job.triager->probe(i.step, m.table, triage_input(job, s, i.step), replay, triage, s.costs);
  const auto start = Clock::now();
  StepResult r{m.record ? std::move(*m.record) : job.judge->decide(m.table, triage), i.lr, 1.0,
               {}, m.seconds, m.all_measured};
  s.costs.decision += seconds_since(start);
  const TensorActions tensors = job.judge->tensors().step(s.shard_stats, r.verdict);  // per tensor
  Verdict& v = r.verdict;
  warn_overflow(i.step, v);
  explain_step(job, s, v, m.table, i.lr, job.sampler->position());
  // The clip (the core's, against training.max_norm or a clip decision's lower bound) and the
  // loss scale are divided out in the update's one pass (grad_scale = scale / clip).
  r.clip = v.clip;
  update(job, i.lr, {v.decision == Decision::kSkip, r.clip, v.loss_scale}, tensors);
  i.decided = std::move(r);
}

// The step decided on the device (lag 1): nothing before the update waits for the host.
void decide_on_device(Job& job, Issued& i) {
  const at::Tensor row = sync_and_row(job, i.s, {});
  TensorPolicies& tensors = job.judge->tensors();
  const at::Tensor mine = tensors.with_sums(row, i.s.shard_stats);  // + per-tensor sums
  const auto start = Clock::now();
  const DeviceDecision::Update u = job.judge->decide_on_device(  // the record form: its row
      job.judge->detector().own_only() ? mine : gather_rows(job.comm.get(), mine), i.step);
  i.s.costs.decision += seconds_since(start);
  update(job, i.lr, UpdateControl::on_device(u.found_inf, u.grad_scale), tensors.on_device(u));
}

// Step 1-based `step` at learning rate `lr`, up to its update.
Issued issue(Job& job, int64_t step, double lr) {
  Issued i{step, lr, compute(job, step), 0, std::nullopt};
  if (job.judge->on_device()) decide_on_device(job, i);
  else decide_on_host(job, i);
  i.data_position = job.sampler->position();
  return i;
}

// The device's verdict of an issued step, a step later: the host takes the same decision from
// the copied table (the device's state is the host's, bit for bit) and checks the device agreed.
StepResult read_device_verdict(Job& job, Issued& i) {
  const auto start = Clock::now();
  StepJudge::Checked late = job.judge->read(i.step);  // the device agreed (else it throws)
  name_by_record(job.judge->detector(), late, job.comm.get());  // the record form's names
  StepResult r{late.verdict, i.lr, late.verdict.clip, {}, late.seconds, late.all_measured};
  i.s.costs.decision += seconds_since(start);
  i.s.costs.wait += late.waited;
  i.s.costs.waits += late.waited > 0 ? 1 : 0;
  Verdict& v = r.verdict;
  warn_overflow(i.step, v);
  explain_step(job, i.s, v, late.table, i.lr, i.data_position);
  return r;
}

// The issued step's verdict reaches the run's state: counters, windows, data position.
StepResult finish(Job& job, Issued& i) {
  StepResult r = i.decided ? std::move(*i.decided) : read_device_verdict(job, i);
  r.costs = i.s.costs;
  count_step(job, r.verdict, i.data_position);
  return r;
}

// The loop: issue step n, finish the step before it if it waited, then step n at once when the
// host decides, when the host needs it (work_after: a log, checkpoint, validation or verify step,
// the last) or after a stop request; its host syncs watched from the third step of this process.
void run(Job& job, Progress& progress, TrainResult& result) {
  job.startup_signals.reset();  // from here a stop signal ends the run at a step boundary
  const StopSignals signals;
  const int64_t first = job.state.step;
  int64_t last_verified = first;  // the last step all ranks were seen to agree
  const bool lag = job.judge->on_device();
  std::unique_ptr<Issued> late;  // the step issued but not yet finished (lag 1)
  bool stopping = false;
  for (int64_t n = first + 1; n <= job.config.training.steps; ++n) {
    const bool now = !lag || stopping || work_after(job, n).any();
    std::optional<SyncWatch> watch;
    if (n >= first + 3 && (!lag || !now)) watch.emplace(true);
    Issued issued = issue(job, n, next_lr(job.schedule, n - 1, job.state.optimizer_steps));
    if (late)
      stopping = after_step(job, progress, result, finish(job, *late), last_verified, false);
    late.reset();
    if (lag) watch.reset();
    if (!now && !stopping) {
      late = std::make_unique<Issued>(std::move(issued));
      continue;
    }
    const StepResult r = finish(job, issued);
    watch.reset();
    after_step(job, progress, result, r, last_verified);
  }
}

TrainResult train_job(Job& job) {
  TrainResult result;
  result.start_step = job.state.step;
  if (job.plan.on_device)
    job.judge->start_device(job.device, job.comm.get());
  Progress progress({job.lead ? job.run_dir + "/metrics.jsonl" : "", job.config.training.steps,
                     job.tokens_per_step, job.judge->detector().loss_scaling(),
                     job.model->flops_per_token(job.config.training.seq_len), job.peak_flops,
                     job.ranks.world_size});
  if (job.lead) job.sink = MetricsSink::start(job.config.metrics, job.run_dir);
  run(job, progress, result);
  finish_run(job, progress, result);
  if (job.sink) job.sink->finish();  // the event files hold every step before train returns
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
