// Stragglers: a rank whose own compute (forward, backward and its check [A]) is slower than the
// others'. Each rank's compute time rides in its stats row (RankStats::compute_seconds), so
// every rank holds every rank's times each step at no extra collective; the watch compares each
// rank's median over a window with the median of the other ranks' medians and names a rank
// slower by diagnostics.straggler_factor. Hangs stay the collective timeout's
// (comm.train_timeout_seconds); this names the rank that every step waits for.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

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

// Every rank's compute seconds: the stats table's column.
std::vector<double> compute_times(const std::vector<RankStats>& table);

struct Straggler {
  int rank = 0;
  double ratio = 0;  // its median compute time over the window / the other ranks' median
};

class StragglerWatch {
 public:
  // factor <= 0 or one rank: off.
  StragglerWatch(double factor, int64_t window, int world);

  // One step's compute seconds of every rank (the stats table's column; 0 = not measured).
  void add(const std::vector<double>& seconds);

  // The ranks slower than factor x the others, once the window is full; empty otherwise.
  const std::vector<Straggler>& slow() const { return slow_; }
  // A rank in slow() that the step before did not name.
  bool newly_named() const { return newly_named_; }

  // "rank 1 (2.3x)", "ranks 1 (2.3x), 4 (1.6x)"; "" for none.
  static std::string text(const std::vector<Straggler>& slow);

 private:
  double factor_;
  size_t window_;
  int world_;
  std::deque<std::vector<double>> steps_;
  std::vector<Straggler> slow_;
  bool newly_named_ = false;
};

}  // namespace lockstep
