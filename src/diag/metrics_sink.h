// metrics.enable_tensorboard / metrics.enable_wandb: rank 0 runs lockstep's metrics sink
// (launch/metrics_sink.py, embedded in the binary) with $LOCKSTEP_PYTHON. It follows
// metrics.jsonl and rank 0's diagnostics events from where they stand at the start and writes
// them through TensorBoard's and W&B's own writers. Its stdin is a pipe from this process:
// closing it (finish(), or this process ending however it ends) tells it to read what is left
// and exit, so the event files hold every step the run logged.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "lockstep/config.h"

namespace lockstep {

class MetricsSink {
 public:
  // Whether the configured writers load in $LOCKSTEP_PYTHON; ConfigError naming the key and the
  // package to install when they do not (a run checks before it starts).
  static void check(const MetricsConfig& metrics);
  // The sink for `run_dir`; null when neither writer is on.
  static std::unique_ptr<MetricsSink> start(const MetricsConfig& metrics,
                                            const std::string& run_dir);
  ~MetricsSink();
  MetricsSink(const MetricsSink&) = delete;
  MetricsSink& operator=(const MetricsSink&) = delete;

  // Closes the pipe and waits for the sink to drain (at most a minute; a warning otherwise).
  void finish();

 private:
  MetricsSink(pid_t pid, int pipe_fd) : pid_(pid), pipe_(pipe_fd) {}
  pid_t pid_;
  int pipe_;
};

}  // namespace lockstep
