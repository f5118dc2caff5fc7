#include "lockstep/bench.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/eq.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <fmt/core.h>
#include <torch/version.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <cstring>
#include <fstream>
#include <functional>
#include <thread>

#include "bench/machine.h"
#include "check/gradcheck.h"
#include "kernels/gradcheck.h"
#include "lockstep/error.h"

#ifdef LOCKSTEP_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>

#include "kernels/device_info.h"
#endif

namespace lockstep {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

at::ScalarType dtype_of(const std::string& s) {
  if (s == "fp32") return at::kFloat;
  if (s == "bf16") return at::kBFloat16;
  if (s == "fp16") return at::kHalf;
  if (s == "fp64") return at::kDouble;
  throw ConfigError("bench: unknown dtype '" + s + "'; use fp32, bf16, fp16 or fp64");
}

struct Data {
  at::Tensor flat;
  std::vector<NamedTensor> grads;
  int64_t bytes;
};

// `bytes` of gradients in one flat buffer, as 8 equal views ("few") or 10,000 ("many").
Data make_data(int64_t bytes, const std::string& layout, at::ScalarType dtype, c10::Device dev) {
  const int64_t elem = c10::elementSize(dtype);
  const int64_t n = bytes / elem;
  const int64_t k = layout == "few" ? 8 : std::min<int64_t>(10000, n);
  Data d;
  d.flat = at::randn({n}, at::TensorOptions().dtype(at::kFloat)).to(dtype).to(dev);
  d.bytes = n * elem;
  int64_t off = 0;
  for (int64_t i = 0; i < k; ++i) {
    int64_t len = n / k + (i == k - 1 ? n % k : 0);
    d.grads.push_back({"g" + std::to_string(i), d.flat.narrow(0, off, len)});
    off += len;
  }
  return d;
}

struct Method {
  std::string name;
  std::function<void()> fn;
  double best = 1e30;  // seconds per call, the best round
};

// Seconds per call for each method: a warm-up call each, then `rounds` rounds in which the
// methods take turns (so drift on a shared machine hits all alike), each round repeating a
// method until min_seconds / rounds have passed. The best round counts, as in
// bandwidth benchmarks: it is the one least disturbed by the rest of the machine. A method
// without a function (one that does not apply to the dtype) is not timed: NaN.
void time_methods(std::vector<Method>& methods, double min_seconds, bool cuda) {
  auto sync = [&] {
#ifdef LOCKSTEP_WITH_CUDA
    if (cuda) c10::cuda::device_synchronize();
#endif
  };
  constexpr int kRounds = 5;
  for (auto& m : methods) {
    if (m.fn) m.fn();
    else m.best = std::numeric_limits<double>::quiet_NaN();
  }
  sync();
  for (int r = 0; r < kRounds; ++r)
    for (auto& m : methods) {
      if (!m.fn) continue;
      int calls = 0;
      const auto start = Clock::now();
      double elapsed = 0;
      do {
        m.fn();
        ++calls;
        sync();
        elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      } while (elapsed < min_seconds / kRounds && calls < 1000);
      m.best = std::min(m.best, elapsed / calls);
    }
}

std::vector<at::Tensor> tensors_of(const Data& d) {
  std::vector<at::Tensor> t;
  for (const auto& g : d.grads) t.push_back(g.tensor);
  return t;
}

// G1: what clip_grad_norm_ does.
at::Tensor g1(const std::vector<at::Tensor>& grads) {
  auto norms = at::_foreach_norm(grads, 2);
  auto total = at::linalg_vector_norm(at::stack(norms), 2);
  return at::isfinite(total);
}

// G2: G1 plus a per-tensor count of nonfinite elements.
at::Tensor g2(const std::vector<at::Tensor>& grads) {
  auto ok = g1(grads);
  std::vector<at::Tensor> counts;
  for (const auto& g : grads) counts.push_back(at::isfinite(g).logical_not().sum());
  return at::stack(counts).sum().add(ok);
}

// G3: the per-tensor loop with a host sync per question.
double g3(const std::vector<at::Tensor>& grads) {
  double sumsq = 0;
  bool bad = false;
  for (const auto& g : grads) {
    bad = bad || g.isnan().any().item<bool>() || g.isinf().any().item<bool>();
    double n = g.norm().item<double>();
    sumsq += n * n;
  }
  return bad ? NAN : sumsq;
}

// memcpy of the same bytes, split over the same threads (CPU only).
void parallel_memcpy(void* dst, const void* src, int64_t bytes) {
  constexpr int64_t kPiece = 1 << 20;
  at::parallel_for(0, (bytes + kPiece - 1) / kPiece, 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      int64_t off = i * kPiece, n = std::min(kPiece, bytes - off);
      std::memcpy(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off, n);
    }
  });
}

// One measured case: the gradients and what each method needs, alive while it is timed.
struct Case {
  Data d;
  std::vector<at::Tensor> grads;
  GradCheck check;
  at::Tensor stats, found_inf, inv_scale, dst;

  Case(Data data) : d(std::move(data)), grads(tensors_of(d)), check(d.grads) {}

  // fused, G1, G2, G3, G5_sum, then G4 (CUDA: the AMP unscale check, then G1; fp32 and fp16
  // only, the dtypes AMP's kernel takes) or memcpy of the same bytes (CPU: read + write).
  std::vector<Method> methods(bool cuda) {
    std::vector<Method> m = {{"fused", [this] { stats = check.run(); }},
                             {"G1", [this] { g1(grads); }},
                             {"G2", [this] { g2(grads); }},
                             {"G3", [this] { g3(grads); }},
                             {"G5_sum", [this] { check.sum_baseline(); }}};
    if (cuda) {
      found_inf = at::zeros({1}, d.flat.options().dtype(at::kFloat));
      inv_scale = at::ones({1}, d.flat.options().dtype(at::kFloat));
      const bool amp = d.flat.scalar_type() == at::kFloat || d.flat.scalar_type() == at::kHalf;
      m.push_back({"G4", nullptr});
      if (amp)
        m.back().fn = [this] {
          at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
          g1(grads);
        };
    } else {
      dst = at::empty_like(d.flat);
      m.push_back({"memcpy", [this] { parallel_memcpy(dst.data_ptr(), d.flat.data_ptr(), d.bytes); }});
    }
    return m;
  }

  // The timed fused result against fp64 _foreach_norm.
  bool fused_is_right() const {
    GradCheckStats s = GradCheck::read(stats);
    auto ref_norms = at::_foreach_norm(grads, 2, at::kDouble);
    double ref = 0;
    bool ok = s.nonfinite == 0 && s.overflow_runs == 0;
    for (size_t i = 0; i < ref_norms.size(); ++i) {
      double r = ref_norms[i].item<double>();
      ref += r * r;
      ok = ok && std::abs(s.tensor_sumsq[i] - r * r) <= 1e-5 * r * r + 1e-30;
    }
    return ok && std::abs(s.sumsq - ref) <= 1e-5 * ref;
  }
};

void print_header(const std::string& machine, c10::Device dev, bool cuda) {
  fmt::print("lockstep bench gradcheck | {} | LibTorch {} | device {} | threads {}\n", machine,
             TORCH_VERSION, dev.str(), at::get_num_threads());
  fmt::print("GB/s of gradient bytes read; ratio = fused speed / method speed\n");
  fmt::print("{:<5} {:<5} {:>7} {:>6} | {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} | {:>6} {:>6} {:>6} "
             "{:>6} {:>6} | {}\n",
             "dtype", "lay", "MB", "tens", "fused", "G1", "G2", "G3", cuda ? "G4" : "memcpy",
             "G5sum", "xG5", "xG1", "xG2", "xG3", cuda ? "xG4" : "", "check");
}

// One case's measurements (methods in Case::methods order), as a table row or a JSON object.
void print_case(const GradcheckBenchOptions& o, const std::string& machine, c10::Device dev,
                const std::string& dt, const std::string& layout, int64_t mb, const Data& d,
                const std::vector<Method>& m, bool ok) {
  const bool cuda = dev.is_cuda();
  const double gb = static_cast<double>(d.bytes) / 1e9, t_fused = m[0].best;
  if (o.json) {
    json j = {{"device", dev.str()}, {"machine", machine},       {"layout", layout},
              {"dtype", dt},         {"bytes", d.bytes},         {"tensors", d.grads.size()},
              {"threads", at::get_num_threads()},                {"ok", ok}};
    for (const auto& x : m) j["gbps"][x.name] = gb / x.best;
    for (size_t i = 1; i < m.size(); ++i) j["ratio_fused_over"][m[i].name] = m[i].best / t_fused;
    if (cuda) {
      j["launches_per_check"] = kernels::kCudaCheckLaunches;
      j["host_syncs_per_check"] = kernels::kCudaCheckHostSyncs;
    }
    fmt::print("{}\n", j.dump());
  } else {
    fmt::print("{:<5} {:<5} {:>7} {:>6} | {:>7.2f} {:>7.2f} {:>7.2f} {:>7.2f} {:>7.2f} "
               "{:>7.2f} | {:>6.2f} {:>6.2f} {:>6.1f} {:>6.1f} {:>6} | {}\n",
               dt, layout, mb, d.grads.size(), gb / t_fused, gb / m[1].best, gb / m[2].best,
               gb / m[3].best, gb / m[5].best, gb / m[4].best, m[4].best / t_fused,
               m[1].best / t_fused, m[2].best / t_fused, m[3].best / t_fused,
               cuda ? fmt::format("{:.2f}", m[5].best / t_fused) : "", ok ? "ok" : "MISMATCH");
  }
  std::fflush(stdout);
}

}  // namespace

static std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

std::string describe_machine(bool cuda) {
#ifdef LOCKSTEP_WITH_CUDA
  if (cuda) {
    auto info = kernels::query_device_info();
    return fmt::format("{}, driver {}.{}, CUDA runtime {}.{}", info.device_name,
                       info.driver_version / 1000, (info.driver_version % 1000) / 10,
                       info.runtime_version / 1000, (info.runtime_version % 1000) / 10);
  }
#endif
  return fmt::format("{}, {} hardware threads, SIMD {}", cpu_model(),
                     std::thread::hardware_concurrency(), kernels::cpu_isa());
}


bool bench_gradcheck(const GradcheckBenchOptions& o) {
  const bool cuda = o.device == "cuda";
#ifndef LOCKSTEP_WITH_CUDA
  if (cuda) throw ConfigError("bench: --device cuda needs a build with LOCKSTEP_CUDA");
#endif
  if (cuda && !at::hasCUDA())
    throw ConfigError("bench: --device cuda but no CUDA device is visible; use --device cpu");
  at::set_num_threads(o.threads);
  const c10::Device dev = cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  const std::string machine = describe_machine(cuda);
  if (!o.json) print_header(machine, dev, cuda);
  bool all_ok = true;
  for (const auto& dt : o.dtypes)
    for (const auto& layout : o.layouts)
      for (int64_t mb : o.sizes_mb) {
        Case c(make_data(mb << 20, layout, dtype_of(dt), dev));
        std::vector<Method> methods = c.methods(cuda);
        time_methods(methods, o.min_seconds, cuda);
        const bool ok = c.fused_is_right();
        all_ok = all_ok && ok;
        print_case(o, machine, dev, dt, layout, mb, c.d, methods, ok);
      }
  if (cuda && !o.json)
    fmt::print("fused check: {} kernel launch and {} host syncs per call (by construction)\n",
               kernels::kCudaCheckLaunches, kernels::kCudaCheckHostSyncs);
  return all_ok;
}

}  // namespace lockstep
