// Stragglers: a rank whose own compute (forward, backward and its check [A]) is slower than the
// others'. Each rank keeps its own compute times over a window (its stats row carries the step's,
// so the decision's exchange says whether every rank measured it); on the steps that report (the
// logged ones) the ranks all-gather one number each, their medians, and the watch names a rank
// whose median is diagnostics.straggler_factor times the median of the other ranks' medians.
// Per step nothing grows with the world; the gather of W numbers happens only on logged steps.
// Hangs stay the collective timeout's (comm.train_timeout_seconds); this names the rank that
// every step waits for.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "lockstep/decision.h"

namespace lockstep {

// This rank's compute time of a step. CPU: wall time between begin() and end(). GPU: the time
// between two events on the current stream, read when they are done (a step later at most; no
// host sync): seconds() is the latest finished measurement, 0 before the first.
class ComputeClock {
 public:
  explicit ComputeClock(c10::Device device);
  ~ComputeClock();
  ComputeClock(const ComputeClock&) = delete;
  ComputeClock& operator=(const ComputeClock&) = delete;
  void begin();
  void end();
  double seconds();

 private:
  struct Events;
  c10::Device device_;
  std::chrono::steady_clock::time_point start_;
  double seconds_ = 0;
  std::unique_ptr<Events> events_;  // GPU only
};

struct Straggler {
  int rank = 0;
  double ratio = 0;  // its median compute time over the window / the other ranks' median
};

class StragglerWatch {
 public:
  // factor <= 0 or one rank: off.
  StragglerWatch(double factor, int64_t window, int world);

  // This rank's compute seconds of a step; `all_measured`: every rank measured that step (on a
  // GPU the first is not), else the step is left out, on every rank alike.
  void add(double seconds, bool all_measured);
  // On a step that reports (every rank calls it at the same step): once the window is full,
  // every rank's median (one all-gather of one number; a null comm: this rank alone) names the
  // ranks slower than factor x the others'; before that, none.
  void evaluate(Comm* comm);

  // This rank's median over a full window (none before, or when the watch is off).
  std::optional<double> median() const;
  // The ranks named at the last evaluate().
  const std::vector<Straggler>& slow() const { return slow_; }
  // A rank in slow() that the evaluation before did not name.
  bool newly_named() const { return newly_named_; }

  // Every rank's median, in rank order: the ranks slower than `factor` x the others' median.
  static std::vector<Straggler> named(const std::vector<double>& medians, double factor);
  // "rank 1 (2.3x)", "ranks 1 (2.3x), 4 (1.6x)"; "" for none.
  static std::string text(const std::vector<Straggler>& slow);

 private:
  double factor_;
  size_t window_;
  std::deque<double> own_;  // this rank's last `window` measured steps
  std::vector<Straggler> slow_;
  bool newly_named_ = false;
};

}  // namespace lockstep
