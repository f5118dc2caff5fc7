// Wall-clock intervals on the monotonic clock, in seconds (what the trainer reports costs in).
#pragma once

#include <chrono>

namespace lockstep {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace lockstep
