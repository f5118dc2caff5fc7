// A run, built once from the config: every component the training step calls, wired to its
// own small config. train.cpp steps it; this file only builds, resumes and saves it.
#pragma once

#include <c10/core/Device.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "check/gradcheck.h"
#include "checkpoint/checkpointer.h"
#include "comm/comm.h"
#include "decide/exchange_plan.h"
#include "decide/judge.h"
#include "decide/triage.h"
#include "diag/event.h"
#include "diag/explain.h"
#include "diag/injector.h"
#include "diag/metrics_sink.h"
#include "diag/stragglers.h"
#include "eval/validation.h"
#include "fingerprint.h"
#include "lockstep/config.h"
#include "lockstep/data.h"
#include "model/model.h"
#include "optim/schedule.h"
#include "parallel/data_parallel.h"
#include "ranks.h"
#include "rundir.h"
#include "runtime.h"

namespace lockstep {

struct Job {
  explicit Job(const Config& c) : config(c) {}

  Config config;
  RankInfo ranks;
  bool lead = true;  // rank 0: writes config, metrics, checkpoints; prints progress
  std::string run_dir;
  std::unique_ptr<RunFolderLock> lock;  // rank 0, while the run lives
  c10::Device device{c10::kCPU};
  std::unique_ptr<Comm> comm;  // null on one rank
  std::unique_ptr<TokenSource> source;
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<FaultInjector> faults;
  std::unique_ptr<Model> model;
  std::unique_ptr<DataParallel> dp;          // gradient buffers, sync, optimizer, update
  std::unique_ptr<GradCheck> local_check;    // [A] this rank's own gradient; null when off
  std::unique_ptr<GradCheck> shard_check;    // [B] the synced slice this rank checks
  // The decision (host or device), its windows, per-tensor policies, events and counters' step.
  std::unique_ptr<StepJudge> judge;
  ExchangePlan plan;  // what each step exchanges and where it is decided (decide/exchange_plan.h)
  std::unique_ptr<Triager> triager;          // pre-sync triage, replays, the probe
  std::map<int, std::vector<int64_t>> suspects;  // ranks a replay or probe blamed, by step
  std::unique_ptr<Checkpointer> checkpointer;
  std::unique_ptr<Validator> validator;      // held-out loss; null when off
  std::unique_ptr<StartupSignals> startup_signals;  // until the first step (runtime.h)
  std::unique_ptr<ComputeClock> compute_clock;  // this rank's compute time (its stats row)
  std::unique_ptr<StragglerWatch> stragglers;   // every rank's, over a window
  std::unique_ptr<MetricsSink> sink;  // rank 0: TensorBoard / W&B; null when off
  double peak_flops = 0;                     // one device's, for MFU; 0 = unknown
  LRScheduleOptions schedule;
  nlohmann::json config_json;  // the resolved config, as checkpoints store it
  Fingerprint fingerprint;     // what every rank must share (agreed at start; meta.json)
  int64_t resume_step = 0;         // the checkpoint every rank resumes from (0: a fresh start)
  std::vector<int64_t> excluded;  // sample ids never drawn, sorted (checkpoints carry them)
  TrainState state;            // counters; what a checkpoint restores
  int64_t tokens_per_step = 0; // global
};

// Builds every component: ranks, logging, device, communicator, data, faults, model, data
// parallelism (with its optimizer), checks, detector, checkpointer, writers.
std::unique_ptr<Job> build_job(const Config& config);

// Loads the checkpoint checkpoint.load_step names after checking it keeps the data order, or
// starts fresh (an earlier run's checkpoints in the folder: job.on_existing); then makes every
// rank hold rank 0's weights, opens the run's files (logs, config.toml, diagnostics: only now,
// so a rejected start leaves nothing behind) and logs the run's shape.
void resume(Job& job);

// A collective checkpoint of the current state (every rank calls it). Returns its folder, or
// "" with checkpoint.enable = false.
std::string save_checkpoint(Job& job);

}  // namespace lockstep
