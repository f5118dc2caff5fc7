// The process a rank runs in: its device, its CPU threads, its global RNG, and the stop
// signals (SIGTERM / SIGINT ask for a clean stop that all ranks agree on at the next step).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <csignal>
#include <string>

#include "lockstep/config.h"

namespace lockstep {

// auto | cpu | cuda -> a device (cuda: the GPU of this local rank, round-robin when ranks
// outnumber GPUs, made current). Throws ConfigError naming training.device when CUDA is asked
// for but missing.
c10::Device resolve_device(DeviceKind kind, int local_rank = 0);

// LOCKSTEP_CUDA_SYNC_DEBUG = warn | error: c10's CUDA sync debug mode, to count or forbid the
// host syncs of a GPU step. A SyncWatch switches it on for its lifetime (the trainer holds one
// around each step after the first two of a process, so setup, warm-up, checkpoints and progress
// lines are not watched); warn prints each sync with the call stack that made it (names need an
// executable linked with -rdynamic), error throws at the first. Unset: off; without CUDA, nothing.
class SyncWatch {
 public:
  explicit SyncWatch(bool watch);
  ~SyncWatch();
  SyncWatch(const SyncWatch&) = delete;
  SyncWatch& operator=(const SyncWatch&) = delete;

 private:
  bool on_ = false;
};

// Reads LOCKSTEP_CUDA_SYNC_DEBUG; throws ConfigError on a value other than warn, error or unset.
// resolve_device calls it for a CUDA device.
void check_sync_debug_mode();

// "cpu", or the GPU's name ("NVIDIA H200").
std::string device_name(c10::Device device);

// What this process may still allocate on the host, and what sets it: the smallest of the
// node's MemAvailable and, for each memory cgroup it is in (v1 or v2, its own and every parent),
// the limit less the usage that is not reclaimable page cache. bytes < 0 when unknown.
struct MemoryLimit {
  double bytes = -1;
  std::string what;  // "the memory cgroup /sys/fs/cgroup/... (limit 2.0 GiB, ...)"
};
MemoryLimit host_memory_limit();

// The memory plan (model_size.h) against what is available, before anything is allocated: on a
// CPU every rank's plan against host_memory_limit shared by the node's `local_ranks`; on a GPU
// the plan without the runtime against the device's free memory. Over it: ConfigError (exit 2)
// naming the limit, with the numbers and the levers. training.check_memory = false skips it.
void check_memory_plan(const Config& c, int world, int local_ranks, c10::Device device);

// Sets ATen's intra-op threads: `threads`, or with 0 this node's cores shared among its
// `local_world_size` ranks. Returns the count set.
int set_intra_op_threads(int64_t threads, int local_world_size);

// The 1-minute load average (Linux /proc/loadavg; 0 elsewhere).
double load_average();
// A warning when `threads` (> 1) intra-op threads per rank, chosen by training.threads = 0,
// meet a machine that other processes keep busy: `load` beyond this job's `local_ranks` reaches
// half of `cores` (OpenMP threads then wait on each other: a run was measured 18x slower); ""
// otherwise.
std::string busy_machine_warning(double load, int cores, int local_ranks, int threads);

// Seeds the global CPU generator (dropout draws from it; a resume restores its state).
void seed_global_rng(uint64_t seed);

// TF32 tensor cores for fp32 matrix products and convolutions on CUDA (training.allow_tf32).
void allow_tf32(bool allow);

// The dtype a precision names.
at::ScalarType dtype_of(Precision p);
at::ScalarType dtype_of(ReducePrecision p);

// While the job starts (rendezvous, data, model, resume), SIGTERM and SIGINT write one line to
// stderr — and to the rank's log file once log_to() named it — and exit with 128 + the signal
// at once: nothing is trained yet, and a scheduler's grace period must not run out in a
// rendezvous wait. Restores the previous handlers when it dies (training's StopSignals next).
class StartupSignals {
 public:
  StartupSignals();
  ~StartupSignals();
  StartupSignals(const StartupSignals&) = delete;
  StartupSignals& operator=(const StartupSignals&) = delete;
  // The file the line also goes to (its folder is created): the rank's log, once this run owns
  // the run folder.
  static void log_to(const std::string& path);

 private:
  struct sigaction old_[2] {};  // SIGTERM's and SIGINT's before
};

// While alive, SIGTERM and SIGINT set a flag instead of killing (a second one kills: the
// handler resets itself). Restores the previous handlers when it dies.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The signal received (SIGTERM or SIGINT), or 0.
  static int received();

 private:
  struct sigaction old_[2] {};  // SIGTERM's and SIGINT's before
};

}  // namespace lockstep
