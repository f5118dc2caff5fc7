#include "runtime.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>

#include "lockstep/error.h"

#ifdef LOCKSTEP_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Backtrace.h>
#include <c10/util/Exception.h>

#include <cstdio>

#include <cstdlib>
#include <string>

#include "kernels/device_info.h"
#endif

namespace lockstep {

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

}  // namespace

StopSignals::StopSignals() {
  g_stop_signal.store(0);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sa.sa_flags = SA_RESTART | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, &old_term_);
  ::sigaction(SIGINT, &sa, &old_int_);
}

StopSignals::~StopSignals() {
  ::sigaction(SIGTERM, &old_term_, nullptr);
  ::sigaction(SIGINT, &old_int_, nullptr);
}

int StopSignals::received() { return g_stop_signal.load(); }

}  // namespace lockstep
