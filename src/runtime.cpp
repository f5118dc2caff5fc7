#include "runtime.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "lockstep/error.h"
#include "lockstep/model_size.h"

#ifdef LOCKSTEP_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Backtrace.h>
#include <c10/util/Exception.h>

#include <cstdio>

#include <cstdlib>
#include <string>

#include "kernels/device_info.h"
#endif

namespace lockstep {
namespace {

// The first number in `path` (a /proc or cgroup file), or -1 (missing, or "max": no limit).
double number_in(const std::string& path, const std::string& key = "") {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (!key.empty() && line.rfind(key, 0) != 0) continue;
    const size_t at = line.find_first_of("0123456789");
    if (at == std::string::npos) return -1;
    return std::stod(line.substr(at));
  }
  return -1;
}

}  // namespace

namespace {

// The memory cgroups this process is in, innermost first, as (folder, v2): from
// /proc/self/cgroup's "0::/path" (v2) or "N:...memory...:/path" (v1), each with its parents up
// to the mount (a container's namespace shows "/": the mount itself).
std::vector<std::pair<std::string, bool>> memory_cgroups() {
  std::vector<std::pair<std::string, bool>> out;
  std::ifstream in("/proc/self/cgroup");
  for (std::string line; std::getline(in, line);) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const bool v2 = line.substr(0, a) == "0" && controllers.empty();
    const bool v1 = controllers.find("memory") != std::string::npos;
    if (!v1 && !v2) continue;
    const std::string mount = v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
    std::filesystem::path path = line.substr(b + 1);
    for (;;) {
      out.emplace_back(mount + (path == "/" ? "" : path.string()), v2);
      if (path == "/" || path.empty()) break;
      path = path.parent_path();
    }
  }
  return out;
}

}  // namespace

MemoryLimit host_memory_limit() {
  MemoryLimit best;
  if (const double kb = number_in("/proc/meminfo", "MemAvailable:"); kb >= 0)
    best = {kb * 1024, "this node's available memory (MemAvailable, reclaimable cache counted "
                       "as free)"};
  // Under a cgroup limit what is free is the limit less the usage that cannot be reclaimed: the
  // page cache the usage counts (inactive files) is given back before the OOM killer runs.
  for (const auto& [folder, v2] : memory_cgroups()) {
    const double max = number_in(folder + (v2 ? "/memory.max" : "/memory.limit_in_bytes"));
    const double used = number_in(folder + (v2 ? "/memory.current" : "/memory.usage_in_bytes"));
    if (max < 0 || used < 0 || max > 1e18) continue;  // no limit, or not this cgroup's file
    const double cache =
        std::max(0.0, number_in(folder + "/memory.stat", v2 ? "inactive_file " : "total_inactive_file "));
    const double free = max - std::max(0.0, used - cache);
    if (best.bytes < 0 || free < best.bytes)
      best = {free, fmt::format("the memory cgroup {} (limit {}, {} in use without its page cache)",
                                folder, bytes_text(max), bytes_text(std::max(0.0, used - cache)))};
  }
  return best;
}

void check_memory_plan(const Config& c, int world, int local_ranks, c10::Device device) {
  if (!c.training.check_memory) return;
  const MemoryPlan plan = memory_plan(c, world, device.is_cuda());
  const MemoryLimit host = host_memory_limit();
  double need = plan.total(), have = host.bytes / std::max(local_ranks, 1);
  std::string where = local_ranks > 1 ? fmt::format("each of this node's {} ranks' share of {}",
                                                    local_ranks, host.what)
                                      : host.what;
#ifdef LOCKSTEP_WITH_CUDA
  if (device.is_cuda()) {
    size_t free = 0, total = 0;
    const c10::cuda::CUDAGuard guard(device.index());
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) return;
    need = plan.device();
    have = static_cast<double>(free);
    where = "the free memory of " + device_name(device) + " " + device.str();
  }
#endif
  if (have < 0 || need <= have) return;
  throw ConfigError(fmt::format(
      "memory plan: each rank needs up to {} ({} of weights, gradients and optimizer state in "
      "{} mode on {} ranks, {} of activations at local batch {} x seq {}{}{}, {} of runtime) but "
      "{} has {}; use parallelism.mode = \"{}\", activation_checkpoint.mode = \"full\", "
      "fewer model.n_layers, a smaller training.local_batch_size (raise "
      "gradient_accumulation_steps to keep the batch) or fewer ranks per node "
      "(training.check_memory = false starts anyway)",
      bytes_text(need), bytes_text(plan.state), name_of(c.parallelism.mode), world,
      bytes_text(plan.activations), c.training.local_batch_size, c.training.seq_len,
      plan.validation > plan.activations
          ? fmt::format(" ({} for a validation pass)", bytes_text(plan.validation))
          : "",
      plan.replay > 0 ? fmt::format(", {} a replay keeps aside", bytes_text(plan.replay)) : "",
      bytes_text(plan.runtime), where, bytes_text(have),
      c.model.name == ModelName::kLlama ? "fsdp" : "sharded"));  // fsdp shards llama only
}

std::string device_name(c10::Device device) {
#ifdef LOCKSTEP_WITH_CUDA
  if (device.is_cuda()) return kernels::query_device_info().device_name;  // device 0's
#endif
  return device.str();
}

c10::Device resolve_device(DeviceKind kind, int local_rank) {
  if (kind == DeviceKind::kCpu) return c10::Device(c10::kCPU);
  const bool cuda = at::hasCUDA();
  if (kind == DeviceKind::kCuda && !cuda)
    throw ConfigError(
        "invalid value for 'training.device': \"cuda\" but no CUDA device is usable (CPU-only "
        "LibTorch or no GPU); use training.device = \"cpu\" or \"auto\"");
  if (!cuda) return c10::Device(c10::kCPU);
  // One GPU per local rank (ranks beyond the GPU count share them round-robin).
  const auto gpus = static_cast<int>(at::getNumGPUs());
  const c10::Device d(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % std::max(1, gpus)));
  c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(d);  // kernels launch on it
  check_sync_debug_mode();
  return d;
}

#ifdef LOCKSTEP_WITH_CUDA
namespace {

c10::cuda::SyncDebugMode sync_debug_mode() {
  static const c10::cuda::SyncDebugMode mode = [] {
    const char* env = std::getenv("LOCKSTEP_CUDA_SYNC_DEBUG");
    const std::string m = env ? env : "";
    if (m.empty()) return c10::cuda::SyncDebugMode::L_DISABLED;
    if (m != "warn" && m != "error")
      throw ConfigError("invalid value for LOCKSTEP_CUDA_SYNC_DEBUG: \"" + m +
                        "\"; expected warn or error (or unset)");
    return m == "warn" ? c10::cuda::SyncDebugMode::L_WARN : c10::cuda::SyncDebugMode::L_ERROR;
  }();
  return mode;
}

// Prints each sync warning once, on one line, followed by the stack that made it; other warnings
// go on to the handler that was there before.
class SyncWarnings : public c10::WarningHandler {
 public:
  explicit SyncWarnings(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& w) override {
    if (w.msg().find("synchronizing CUDA operation") == std::string::npos) return next_->process(w);
    const std::string stack = c10::get_backtrace(/*frames_to_skip=*/1, /*frames=*/32);
    std::fprintf(stderr, "lockstep: host sync: called a synchronizing CUDA operation\n%s\n",
                 stack.c_str());
  }

 private:
  c10::WarningHandler* next_;
};

}  // namespace
#endif

void check_sync_debug_mode() {
#ifdef LOCKSTEP_WITH_CUDA
  sync_debug_mode();
#endif
}

SyncWatch::SyncWatch(bool watch) {
#ifdef LOCKSTEP_WITH_CUDA
  const c10::cuda::SyncDebugMode mode = sync_debug_mode();
  if (!watch || mode == c10::cuda::SyncDebugMode::L_DISABLED) return;
  static SyncWarnings handler(c10::WarningUtils::get_warning_handler());
  c10::WarningUtils::set_warning_handler(&handler);  // this thread's (the step's) warnings
  c10::cuda::warning_state().set_sync_debug_mode(mode);
  on_ = true;
#else
  (void)watch;
#endif
}

SyncWatch::~SyncWatch() {
#ifdef LOCKSTEP_WITH_CUDA
  if (on_) c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
#endif
}

int set_intra_op_threads(int64_t threads, int local_world_size) {
  const int n = threads > 0 ? static_cast<int>(threads)
                            : static_cast<int>(std::thread::hardware_concurrency()) /
                                  std::max(1, local_world_size);
  at::set_num_threads(std::max(1, n));
  return at::get_num_threads();
}

double load_average() {
  std::ifstream in("/proc/loadavg");
  double load = 0;
  return in >> load ? load : 0;
}

std::string busy_machine_warning(double load, int cores, int local_ranks, int threads) {
  const double others = load - local_ranks;
  if (threads <= 1 || cores <= 0 || others < 0.5 * cores) return "";
  return fmt::format("the machine is busy: load average {:.1f} on {} cores besides this job's {} "
                     "rank(s); {} intra-op threads per rank (training.threads = 0: cores / local "
                     "ranks) compete with it and can run many times slower; set "
                     "training.threads = 1, or free the machine",
                     load, cores, local_ranks, threads);
}

void seed_global_rng(uint64_t seed) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
}

void allow_tf32(bool allow) {
  at::globalContext().setAllowTF32CuBLAS(allow);
  at::globalContext().setAllowTF32CuDNN(allow);
}

at::ScalarType dtype_of(Precision p) {
  switch (p) {
    case Precision::kFloat32: return at::kFloat;
    case Precision::kBFloat16: return at::kBFloat16;
    case Precision::kFloat16: return at::kHalf;
  }
  return at::kFloat;
}

at::ScalarType dtype_of(ReducePrecision p) {
  return p == ReducePrecision::kBFloat16 ? at::kBFloat16 : at::kFloat;
}

namespace {

std::atomic<int> g_stop_signal{0};

extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

// StartupSignals' log file and its folder (fixed buffers: the handler only reads them).
char g_startup_log[4096] = "";
char g_startup_log_dir[4096] = "";

// Async-signal-safe only: write, mkdir, open, close, _exit.
extern "C" void on_startup_signal(int sig) {
  const char* text = sig == SIGINT
                         ? "lockstep: error: stopped by SIGINT during start-up, before the first "
                           "step: nothing trained; run the same command again to start\n"
                         : "lockstep: error: stopped by SIGTERM during start-up, before the first "
                           "step: nothing trained; run the same command again to start\n";
  const size_t n = std::strlen(text);
  if (::write(STDERR_FILENO, text, n) < 0) {
  }
  if (g_startup_log[0] != 0) {
    ::mkdir(g_startup_log_dir, 0755);
    const int fd = ::open(g_startup_log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) {
      if (::write(fd, text, n) < 0) {
      }
      ::close(fd);
    }
  }
  ::_exit(128 + sig);
}

// `handler` for SIGTERM and SIGINT, the previous dispositions kept in `old` (term, int).
void install(void (*handler)(int), int flags, struct sigaction (&old)[2]) {
  struct sigaction sa {};
  sa.sa_handler = handler;
  sa.sa_flags = flags;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, &old[0]);
  ::sigaction(SIGINT, &sa, &old[1]);
}

void restore(const struct sigaction (&old)[2]) {
  ::sigaction(SIGTERM, &old[0], nullptr);
  ::sigaction(SIGINT, &old[1], nullptr);
}

}  // namespace

StartupSignals::StartupSignals() { install(on_startup_signal, 0, old_); }

StartupSignals::~StartupSignals() {
  restore(old_);
  g_startup_log[0] = 0;
}

void StartupSignals::log_to(const std::string& path) {
  const std::string dir = std::filesystem::path(path).parent_path().string();
  if (path.size() >= sizeof g_startup_log || dir.size() >= sizeof g_startup_log_dir) return;
  std::memcpy(g_startup_log_dir, dir.c_str(), dir.size() + 1);
  std::memcpy(g_startup_log + 1, path.c_str() + 1, path.size());  // a complete path once
  g_startup_log[0] = path.empty() ? 0 : path[0];                  // its first byte is set
}

StopSignals::StopSignals() {
  g_stop_signal.store(0);
  install(on_stop_signal, SA_RESTART | SA_RESETHAND, old_);
}

StopSignals::~StopSignals() { restore(old_); }

int StopSignals::received() { return g_stop_signal.load(); }

}  // namespace lockstep
