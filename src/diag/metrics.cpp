#include "diag/metrics.h"

#include <fmt/core.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <string>

#include "log.h"

namespace lockstep {

double resident_mib() {
  std::ifstream in("/proc/self/statm");
  long long size = 0, resident = 0;
  if (!(in >> size >> resident)) return 0;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / 1048576.0;
}

double peak_resident_mib() {
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key) {
    if (key == "VmHWM:") {
      double kib = 0;
      in >> kib;
      return kib / 1024.0;
    }
    in.ignore(1 << 16, '\n');
  }
  return 0;
}

bool reset_peak_resident() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

std::string format_eta(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{}:{:02d}", s / 60, s % 60);
}

Progress::Progress(const std::string& metrics_path, int64_t total_steps, int64_t tokens_per_step,
                   int64_t log_freq, bool show_scale)
    : metrics_(metrics_path),
      total_steps_(total_steps),
      tokens_per_step_(tokens_per_step),
      log_freq_(log_freq),
      show_scale_(show_scale) {}

double Progress::elapsed() const {
  return std::chrono::duration<double>(Clock::now() - start_).count();
}

void Progress::step_done(const TrainState& state, const Verdict& v, const SkipDetector& detector,
                         double lr, double clip, double decision_seconds) {
  ++interval_steps_;
  interval_decision_s_ += decision_seconds;
  if (state.step % log_freq_ != 0 && state.step != total_steps_) return;
  const auto now = Clock::now();
  const double secs = std::chrono::duration<double>(now - interval_start_).count();
  const double steps = static_cast<double>(interval_steps_);
  const double ms_per_step = 1e3 * secs / steps;
  const double tok_s = steps * static_cast<double>(tokens_per_step_) / secs;
  const double eta = static_cast<double>(total_steps_ - state.step) * ms_per_step / 1e3;
  const std::string scale =
      show_scale_ ? fmt::format(" | scale {:g} ({} overflows)", v.loss_scale, state.overflow_skips)
                  : "";
  log::info("step {:>6}/{} | loss {:.4f} | grad_norm {:.4f} | lr {:.3e} | skipped {}{} | "
            "ms/step {:.1f} | tok/s {:.0f} | ETA {}",
            state.step, total_steps_, v.loss, v.grad_norm, lr, state.skipped_steps, scale,
            ms_per_step, tok_s, format_eta(eta));
  metrics_.write({{"step", state.step},
                  {"loss", json_number(v.loss)},
                  {"grad_norm", json_number(v.grad_norm)},
                  {"clip_coef", clip},
                  {"lr", lr},
                  {"decision", decision_name(v.decision)},
                  {"ms_per_step", ms_per_step},
                  {"decision_ms", 1e3 * interval_decision_s_ / steps},
                  {"tokens_per_s", tok_s},
                  {"tokens_seen", state.tokens_seen},
                  {"optimizer_steps", state.optimizer_steps},
                  {"skipped_steps", state.skipped_steps},
                  {"overflow_skips", state.overflow_skips},
                  {"loss_scale", v.loss_scale},
                  {"consecutive_skips", detector.consecutive_skips()},
                  {"skip_rate", static_cast<double>(state.skipped_steps) /
                                    static_cast<double>(state.step)},
                  {"window_history", detector.history()},
                  {"grad_norm_mean", json_number(detector.grad_norms().mean())},
                  {"grad_norm_std", json_number(detector.grad_norms().stddev())},
                  {"loss_mean", json_number(detector.losses().mean())},
                  {"loss_std", json_number(detector.losses().stddev())},
                  {"rss_mib", resident_mib()},
                  {"elapsed_s", std::chrono::duration<double>(now - start_).count()}});
  interval_start_ = now;
  interval_steps_ = 0;
  interval_decision_s_ = 0;
}

}  // namespace lockstep
