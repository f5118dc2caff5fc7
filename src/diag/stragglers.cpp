#include "diag/stragglers.h"

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace lockstep {


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
    : factor_(world > 1 ? factor : 0), window_(static_cast<size_t>(window)) {}

void StragglerWatch::add(double seconds, bool measured) {
  if (factor_ <= 0 || window_ == 0 || !measured) return;
  own_.push_back(seconds);
  if (own_.size() > window_) own_.pop_front();
}

std::optional<double> StragglerWatch::median() const {
  if (factor_ <= 0 || window_ == 0 || own_.size() < window_) return std::nullopt;
  return lockstep::median({own_.begin(), own_.end()});
}

void StragglerWatch::evaluate(Comm* comm) {
  if (factor_ <= 0 || window_ == 0) return;
  const std::vector<Straggler> before = std::move(slow_);
  slow_.clear();
  newly_named_ = false;
  const std::optional<double> mine = median();
  if (!mine) return;  // the same count on every rank: all return here alike
  std::vector<double> medians;
  for (const auto& m : all_gather_values(comm, {*mine})) medians.push_back(m[0]);
  slow_ = named(medians, factor_);
  for (const Straggler& s : slow_) {
    const auto same = [&s](const Straggler& b) { return b.rank == s.rank; };
    newly_named_ = newly_named_ || std::none_of(before.begin(), before.end(), same);
  }
}

std::vector<Straggler> StragglerWatch::named(const std::vector<double>& own, double factor) {
  std::vector<Straggler> out;
  if (own.size() < 2) return out;
  std::vector<double> sorted = own;
  std::sort(sorted.begin(), sorted.end());
  for (size_t r = 0; r < own.size(); ++r) {
    const auto k = static_cast<size_t>(
        std::lower_bound(sorted.begin(), sorted.end(), own[r]) - sorted.begin());
    const double ratio = own[r] / median_without(sorted, k);
    if (ratio >= factor) out.push_back({static_cast<int>(r), ratio});
  }
  return out;
}

std::string StragglerWatch::text(const std::vector<Straggler>& slow) {
  std::vector<std::string> parts;
  for (const Straggler& s : slow) parts.push_back(fmt::format("{} ({:.1f}x)", s.rank, s.ratio));
  if (parts.empty()) return "";
  return fmt::format("rank{} {}", parts.size() > 1 ? "s" : "", fmt::join(parts, ", "));
}

}  // namespace lockstep
