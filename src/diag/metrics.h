// Progress: the line rank 0 prints every metrics.log_freq steps and the record it appends to
// RUN_DIR/metrics.jsonl (one RFC 8259 JSON object per logged step), with rates over the steps
// since the last one. Also this process's memory.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "run_state.h"
#include "decide/detector.h"
#include "diag/event.h"
#include "diag/stragglers.h"

namespace lockstep {

// This process's resident memory now and at its peak, in MiB (Linux /proc; 0 elsewhere).
double resident_mib();
double peak_resident_mib();
// Hands the heap's free memory back to the system (jemalloc's purge of every arena when it is
// the process's malloc, else glibc's malloc_trim): what setup freed (the model drawn on the
// CPU, then moved or sharded) would otherwise stay resident.
void return_free_memory();
// Starts a new peak (Linux: /proc/self/clear_refs); false where the kernel does not allow it.
bool reset_peak_resident();

// "m:ss" or "h:mm:ss"; "?" for a nonfinite or negative time.
std::string format_eta(double seconds);

// Peak dense FLOP/s of a known GPU (by its CUDA device name) in the compute dtype: bf16 and
// fp16 tensor cores, TF32 for fp32 when allowed, else plain fp32. 0 for an unknown device.
double known_peak_flops(const std::string& device_name, Precision compute, bool allow_tf32);

struct ProgressOptions {
  std::string metrics_path;  // "" writes no file (ranks other than 0)
  int64_t total_steps = 0;
  int64_t tokens_per_step = 0;  // global
  bool show_scale = false;      // the line shows the loss scale (fp16 loss scaling on)
  double flops_per_token = 0;   // the model's training FLOPs per token
  double peak_flops = 0;        // one device's peak FLOP/s; 0 = no MFU
  int64_t devices = 1;          // ranks (tokens_per_step is theirs together)
};

class Progress {
 public:
  explicit Progress(ProgressOptions options);

  // Counts the step `state` has just completed (`costs`: what its decision machinery cost);
  // when `log` (a logged step), prints the progress line and writes the metrics record.
  // `slow`: the ranks the straggler watch names now.
  void step_done(const TrainState& state, const Verdict& verdict, const SkipDetector& detector,
                 double lr, double clip, const StepCosts& costs,
                 const std::vector<Straggler>& slow, bool log);

  // A validation ran after `step`: its log line and metrics record; its time is left out of
  // the step rates.
  void validation_done(int64_t step, double loss, double perplexity, int64_t samples,
                       double seconds);

  // Seconds since the start of the run (this process).
  double elapsed() const;

 private:
  using Clock = std::chrono::steady_clock;
  void print_line(const TrainState& state, const Verdict& v, double lr, double ms_per_step,
                  double tok_s, double mfu, const std::vector<Straggler>& slow) const;
  ProgressOptions opt_;
  JsonlWriter metrics_;
  double last_val_loss_ = -1;  // none yet
  Clock::time_point start_ = Clock::now(), interval_start_ = start_;
  int64_t interval_steps_ = 0;
  StepCosts interval_costs_;
};

}  // namespace lockstep
