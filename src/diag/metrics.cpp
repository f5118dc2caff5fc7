#include "diag/metrics.h"

#include <dlfcn.h>
#include <fmt/core.h>
#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <cmath>
#include <fstream>
#include <string>

#include "decide/names.h"
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

void return_free_memory() {
  // jemalloc (CMakeLists.txt links it when installed) answers mallctl; looked up, not linked,
  // so a build with the C library's malloc runs the same code.
  using Mallctl = int (*)(const char*, void*, size_t*, void*, size_t);
  static const auto mallctl = reinterpret_cast<Mallctl>(::dlsym(RTLD_DEFAULT, "mallctl"));
  if (mallctl) {
    mallctl("arena.4096.purge", nullptr, nullptr, nullptr, 0);  // 4096: MALLCTL_ARENAS_ALL
    return;
  }
#ifdef __GLIBC__
  ::malloc_trim(0);
#endif
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

double known_peak_flops(const std::string& name, Precision compute, bool allow_tf32) {
  // Dense tensor-core peaks from NVIDIA's data sheets, TFLOP/s: {16-bit, TF32, fp32}. The more
  // specific names first (an "A100" is no "A10", an "L40S" no "L4").
  struct Peak {
    const char* name;
    double half, tf32, fp32;
  };
  static constexpr Peak kPeaks[] = {
      {"B200", 2250, 1100, 80},  {"H100 PCIe", 756, 378, 51}, {"H200", 989.4, 494.7, 66.9},
      {"H100", 989.4, 494.7, 66.9}, {"A100", 312, 156, 19.5}, {"L40S", 362, 183, 91.6},
      {"L4", 121, 60, 30.3},     {"A10", 125, 62.5, 31.2}};
  for (const Peak& p : kPeaks)
    if (name.find(p.name) != std::string::npos) {
      const double tflops = compute != Precision::kFloat32 ? p.half : allow_tf32 ? p.tf32 : p.fp32;
      return tflops * 1e12;
    }
  return 0;
}

Progress::Progress(ProgressOptions options)
    : opt_(std::move(options)), metrics_(opt_.metrics_path) {}

void Progress::validation_done(int64_t step, double loss, double perplexity, int64_t samples,
                               double seconds) {
  last_val_loss_ = loss;
  interval_start_ += std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(seconds));
  log::info("validation at step {}: loss {:.4f}, perplexity {:.3f} ({} samples, {:.1f} s)", step,
            loss, perplexity, samples, seconds);
  metrics_.write({{"event", "validation"},
                  {"step", step},
                  {"val_loss", json_number(loss)},
                  {"val_perplexity", json_number(perplexity)},
                  {"samples", samples},
                  {"seconds", seconds}});
}

void Progress::print_line(const TrainState& state, const Verdict& v, double lr,
                          double ms_per_step, double tok_s, double mfu,
                          const std::vector<Straggler>& slow) const {
  const double eta = static_cast<double>(opt_.total_steps - state.step) * ms_per_step / 1e3;
  std::string extra;
  if (opt_.show_scale)
    extra += fmt::format(" | scale {:g} ({} overflows)", v.loss_scale, state.overflow_skips);
  if (last_val_loss_ >= 0) extra += fmt::format(" | val {:.4f}", last_val_loss_);
  if (mfu > 0) extra += fmt::format(" | MFU {:.1f}%", 100 * mfu);
  if (!slow.empty()) extra += " | slow " + StragglerWatch::text(slow);
  log::info("step {:>6}/{} | loss {:.4f} | grad_norm {:.4f} | lr {:.3e} | skipped {}{} | "
            "ms/step {:.1f} | tok/s {:.0f} | ETA {}",
            state.step, opt_.total_steps, v.loss, v.grad_norm, lr, state.skipped_steps, extra,
            ms_per_step, tok_s, format_eta(eta));
}

double Progress::elapsed() const {
  return std::chrono::duration<double>(Clock::now() - start_).count();
}

void Progress::step_done(const TrainState& state, const Verdict& v, const SkipDetector& detector,
                         double lr, double clip, const StepCosts& costs,
                         const std::vector<Straggler>& slow, bool log) {
  ++interval_steps_;
  interval_costs_.decision += costs.decision;
  interval_costs_.sync += costs.sync;
  interval_costs_.triage += costs.triage;
  interval_costs_.replay += costs.replay;
  interval_costs_.wait += costs.wait;
  interval_costs_.waits += costs.waits;
  if (!log) return;
  const auto now = Clock::now();
  const double secs = std::chrono::duration<double>(now - interval_start_).count();
  const double steps = static_cast<double>(interval_steps_);
  const double ms_per_step = 1e3 * secs / steps;
  const double tok_s = steps * static_cast<double>(opt_.tokens_per_step) / secs;
  const double mfu = opt_.peak_flops > 0 ? tok_s * opt_.flops_per_token /
                                               (static_cast<double>(opt_.devices) * opt_.peak_flops)
                                         : 0;
  print_line(state, v, lr, ms_per_step, tok_s, mfu, slow);
  const WindowSummary w = detector.window();
  nlohmann::json record = counters_json(state);  // step, optimizer_steps, skipped_steps, ...
  record.update({{"loss", json_number(v.loss)},
                  {"grad_norm", json_number(v.grad_norm)},
                  {"clip_coef", clip},
                  {"lr", lr},
                  {"decision", decision_name(v.decision)},
                  {"ms_per_step", ms_per_step},
                  {"decision_ms", 1e3 * interval_costs_.decision / steps},
                  {"sync_ms", 1e3 * interval_costs_.sync / steps},
                  {"triage_ms", 1e3 * interval_costs_.triage / steps},
                  {"replay_ms", 1e3 * interval_costs_.replay / steps},
                  {"host_wait_ms", 1e3 * interval_costs_.wait / steps},
                  {"host_waits", static_cast<double>(interval_costs_.waits) / steps},
                  {"tokens_per_s", tok_s},
                  {"mfu", mfu > 0 ? nlohmann::json(mfu) : nlohmann::json()},
                  {"loss_scale", v.loss_scale},
                  {"consecutive_skips", detector.consecutive_skips()},
                  {"skip_rate", static_cast<double>(state.skipped_steps) /
                                    static_cast<double>(state.step)},
                  {"window_history", w.history},
                  {"grad_norm_mean", json_number(w.grad_norm_mean)},
                  {"grad_norm_std", json_number(w.grad_norm_std)},
                  {"loss_mean", json_number(w.loss_mean)},
                  {"loss_std", json_number(w.loss_std)},
                  {"rss_mib", resident_mib()},
                  {"elapsed_s", std::chrono::duration<double>(now - start_).count()}});
  if (!slow.empty()) {
    nlohmann::json ranks = nlohmann::json::array();
    for (const Straggler& s : slow) ranks.push_back({{"rank", s.rank}, {"ratio", s.ratio}});
    record["stragglers"] = ranks;
  }
  metrics_.write(record);
  interval_start_ = now;
  interval_steps_ = 0;
  interval_costs_ = {};
}

}  // namespace lockstep
