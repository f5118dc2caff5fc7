// Progress: the line rank 0 prints every metrics.log_freq steps and the record it appends to
// RUN_DIR/metrics.jsonl (one RFC 8259 JSON object per logged step), with rates over the steps
// since the last one. Also this process's memory.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "checkpoint/checkpointer.h"
#include "decide/detector.h"
#include "diag/event.h"

namespace lockstep {

// This process's resident memory now and at its peak, in MiB (Linux /proc; 0 elsewhere).
double resident_mib();
double peak_resident_mib();
// Starts a new peak (Linux: /proc/self/clear_refs); false where the kernel does not allow it.
bool reset_peak_resident();

// "m:ss" or "h:mm:ss"; "?" for a nonfinite or negative time.
std::string format_eta(double seconds);

class Progress {
 public:
  // `metrics_path` "" writes no file (ranks other than 0). `tokens_per_step` is global.
  // `show_scale`: the progress line shows the loss scale (fp16 loss scaling on).
  Progress(const std::string& metrics_path, int64_t total_steps, int64_t tokens_per_step,
           int64_t log_freq, bool show_scale = false);

  // Counts the step `state` has just completed (`decision_seconds`: what its checks and stats
  // exchange cost, the gradient sync excluded); on a logged step, prints the progress line and
  // writes the metrics record.
  void step_done(const TrainState& state, const Verdict& verdict, const SkipDetector& detector,
                 double lr, double clip, double decision_seconds);

  // Seconds since the start of the run (this process).
  double elapsed() const;

 private:
  using Clock = std::chrono::steady_clock;
  JsonlWriter metrics_;
  int64_t total_steps_, tokens_per_step_, log_freq_;
  bool show_scale_;
  Clock::time_point start_ = Clock::now(), interval_start_ = start_;
  int64_t interval_steps_ = 0;
  double interval_decision_s_ = 0;
};

}  // namespace lockstep
