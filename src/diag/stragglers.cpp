#include "diag/stragglers.h"

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace lockstep {

std::vector<double> compute_times(const std::vector<RankStats>& table) {
  std::vector<double> out;
  for (const RankStats& r : table) out.push_back(r.compute_seconds);
  return out;
}

namespace {

double median(std::vector<double> x) {
  if (x.empty()) return 0;
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

// The median of `sorted` (at least 2 values) without its element at `k`: the other ranks'
// median, averaged over the middle two when they are even in number (unlike the decision core's
// median_of_others, which takes the lower one), in O(1) from one sort of every rank's value.
double median_without(const std::vector<double>& sorted, size_t k) {
  const size_t m = sorted.size() - 1;
  const auto at = [&](size_t i) { return sorted[i < k ? i : i + 1]; };
  return m % 2 ? at(m / 2) : 0.5 * (at(m / 2 - 1) + at(m / 2));
}

}  // namespace

// Two events around the compute on the device's stream; `pending`: recorded, not read yet.
struct ComputeClock::Events {
  explicit Events(c10::DeviceType type)
      : start(type, c10::EventFlag::BACKEND_DEFAULT), stop(type, c10::EventFlag::BACKEND_DEFAULT) {}
  c10::Event start, stop;
  bool pending = false;
};

ComputeClock::ComputeClock(c10::Device device) : device_(device) {
  if (!device.is_cpu()) events_ = std::make_unique<Events>(device.type());
}

ComputeClock::~ComputeClock() = default;

void ComputeClock::begin() {
  if (!events_) {
    start_ = std::chrono::steady_clock::now();
    return;
  }
  seconds();  // read the last pair before it is recorded again
  if (events_->pending) return;  // still running: skip this step's measurement
  events_->start.record(c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_));
}

void ComputeClock::end() {
  if (!events_) {
    seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    return;
  }
  if (events_->pending) return;
  events_->stop.record(c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_));
  events_->pending = true;
}

double ComputeClock::seconds() {
  if (events_ && events_->pending && events_->stop.query()) {
    seconds_ = events_->start.elapsedTime(events_->stop) / 1e3;  // ms
    events_->pending = false;
  }
  return seconds_;
}

StragglerWatch::StragglerWatch(double factor, int64_t window, int world)
    : factor_(world > 1 ? factor : 0), window_(static_cast<size_t>(window)), world_(world) {}

void StragglerWatch::add(const std::vector<double>& seconds) {
  if (factor_ <= 0 || window_ == 0 || static_cast<int>(seconds.size()) != world_) return;
  if (std::any_of(seconds.begin(), seconds.end(), [](double s) { return !(s > 0); }))
    return;  // a rank without a measurement yet (a GPU's first step)
  steps_.push_back(seconds);
  if (steps_.size() > window_) steps_.pop_front();
  const std::vector<Straggler> before = std::move(slow_);
  slow_.clear();
  newly_named_ = false;
  if (steps_.size() < window_) return;
  std::vector<double> own(static_cast<size_t>(world_));
  for (int r = 0; r < world_; ++r) {
    std::vector<double> times;
    for (const auto& s : steps_) times.push_back(s[static_cast<size_t>(r)]);
    own[static_cast<size_t>(r)] = median(times);
  }
  std::vector<double> sorted = own;
  std::sort(sorted.begin(), sorted.end());
  for (int r = 0; r < world_; ++r) {
    const double v = own[static_cast<size_t>(r)];
    const auto k = static_cast<size_t>(
        std::lower_bound(sorted.begin(), sorted.end(), v) - sorted.begin());
    const double ratio = v / median_without(sorted, k);
    if (ratio < factor_) continue;
    slow_.push_back({r, ratio});
    newly_named_ = newly_named_ || std::none_of(before.begin(), before.end(),
                                                [r](const Straggler& s) { return s.rank == r; });
  }
}

std::string StragglerWatch::text(const std::vector<Straggler>& slow) {
  std::vector<std::string> parts;
  for (const Straggler& s : slow) parts.push_back(fmt::format("{} ({:.1f}x)", s.rank, s.ratio));
  if (parts.empty()) return "";
  return fmt::format("rank{} {}", parts.size() > 1 ? "s" : "", fmt::join(parts, ", "));
}

}  // namespace lockstep
