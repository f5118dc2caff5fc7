// What follows a step's decision beyond its update, for the step and the loop in train.cpp:
// the counters, an anomalous step's event and message (an abort keeps the last good state and
// stops every rank alike), progress, validation, the replica vote, checkpoints, a stop all
// ranks agreed on, and the run's closing line.
#pragma once

#include <cstdint>
#include <vector>

#include "compute.h"
#include "decide/exchange.h"
#include "diag/metrics.h"
#include "job.h"
#include "lockstep/train.h"

namespace lockstep {

struct StepResult {
  Verdict verdict;
  double lr = 0, clip = 1.0;
  StepCosts costs;
  double compute_seconds = 0;  // this rank's (stragglers)
  bool all_measured = false;   // every rank measured its compute this step
};

// The decided step's counters and state; `data_position`: the sampler's after its batch.
void count_step(Job& job, const Verdict& v, int64_t data_position);

// A warning when the gradient's squares overflowed fp32 (summed in fp64) with nothing nonfinite.
void warn_overflow(int64_t step, const Verdict& v);

// What the host does after step n (1-based), each a reason to finish a device-decided step at
// once: after_step acts on exactly these.
struct AfterStep {
  bool log = false, validate = false, verify = false, save = false, last = false;
  bool any() const { return log || validate || verify || save || last; }
};
AfterStep work_after(const Job& job, int64_t n);

// After a step: progress, validate, verify, save; a stop (unless `may_stop` is false: the
// device loop then finishes the step after it first). Returns whether a stop was asked.
bool after_step(Job& job, Progress& progress, TrainResult& result, const StepResult& r,
                int64_t& last_verified, bool may_stop = true);

// Every rank writes its event (its own view plus the agreed table, every rank's sample ids in
// `samples`) for the step after job.state.step, whose batch left the sampler at
// `data_position`; anything but an abort is logged. No collective.
Event explain(Job& job, const RankStep& s, const Verdict& v, const std::vector<RankStats>& table,
              const SampleTable& samples, double lr, int64_t data_position);

// A step with nonfinite values, checked against the model: every rank counts the nonfinite
// values of the parameters it holds and the counts are exchanged (a collective: every rank
// calls it on the same anomalous steps); any found turn `v` into an abort blaming the model
// (decide/judge.h: blame_model), nothing quarantined.
void judge_model(Job& job, Verdict& v);

// An abort's end: every rank saves the last good state (the weights are still it; not when the
// parameters are what is nonfinite) and throws TrainingAborted with the event's one line (exit
// 4, or 5 for skip.on_hardware_fault).
[[noreturn]] void abort_run(Job& job, const Event& e, const Verdict& v);

// Every rank saw the same stop request in the same all-gather: all stop after this step
// (saving it unless `saved`), or, when a stop cut the step short (Verdict::interrupted), at
// the step before it. Throws the Error that ends the run with 128 + the signal.
[[noreturn]] void stop(Job& job, bool saved);

// Verifies the replicas (diagnostics.verify_every); a desync stops the job naming the ranks.
void verify(Job& job, int64_t& last_verified);

// The held-out loss (every rank evaluates its share).
void validate(Job& job, Progress& progress);

// Fills the result's totals from job.state and logs the closing line.
void finish_run(Job& job, const Progress& progress, TrainResult& result);

}  // namespace lockstep
