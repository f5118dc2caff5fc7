#include "bench.h"

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
#include <cstring>
#include <fstream>
#include <functional>
#include <thread>

#include "comm.h"
#include "gradcheck.h"
#include "lockstep/ranks.h"
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

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

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
// bandwidth benchmarks: it is the one least disturbed by the rest of the machine.
void time_methods(std::vector<Method>& methods, double min_seconds, bool cuda) {
  auto sync = [&] {
#ifdef LOCKSTEP_WITH_CUDA
    if (cuda) c10::cuda::device_synchronize();
#endif
  };
  constexpr int kRounds = 5;
  for (auto& m : methods) m.fn();
  sync();
  for (int r = 0; r < kRounds; ++r)
    for (auto& m : methods) {
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

}  // namespace

bool bench_gradcheck(const GradcheckBenchOptions& o) {
  const bool cuda = o.device == "cuda";
#ifndef LOCKSTEP_WITH_CUDA
  if (cuda) throw ConfigError("bench: --device cuda needs a build with LOCKSTEP_CUDA");
#endif
  if (cuda && !at::hasCUDA())
    throw ConfigError("bench: --device cuda but no CUDA device is visible; use --device cpu");
  at::set_num_threads(o.threads);
  const c10::Device dev = cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  std::string machine;
#ifdef LOCKSTEP_WITH_CUDA
  if (cuda) {
    auto info = kernels::query_device_info();
    machine = fmt::format("{}, driver {}.{}, CUDA runtime {}.{}", info.device_name,
                          info.driver_version / 1000, (info.driver_version % 1000) / 10,
                          info.runtime_version / 1000, (info.runtime_version % 1000) / 10);
  }
#endif
  if (!cuda)
    machine = fmt::format("{}, {} hardware threads, SIMD {}", cpu_model(),
                          std::thread::hardware_concurrency(), kernels::cpu_isa());
  if (!o.json) {
    fmt::print("lockstep bench gradcheck | {} | LibTorch {} | device {} | threads {}\n", machine,
               TORCH_VERSION, dev.str(), at::get_num_threads());
    fmt::print("GB/s of gradient bytes read; ratio = fused speed / method speed\n");
    fmt::print("{:<5} {:<5} {:>7} {:>6} | {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} | {:>6} {:>6} {:>6} "
               "{:>6} {:>6} | {}\n",
               "dtype", "lay", "MB", "tens", "fused", "G1", "G2", "G3", cuda ? "G4" : "memcpy",
               "G5sum", "xG5", "xG1", "xG2", "xG3", cuda ? "xG4" : "", "check");
  }
  bool all_ok = true;
  for (const auto& dt : o.dtypes)
    for (const auto& layout : o.layouts)
      for (int64_t mb : o.sizes_mb) {
        Data d = make_data(mb << 20, layout, dtype_of(dt), dev);
        auto grads = tensors_of(d);
        GradCheck check(d.grads);
        at::Tensor stats;
        const double gb = static_cast<double>(d.bytes) / 1e9;
        auto rate = [&](double s) { return gb / s; };

        std::vector<Method> methods = {
            {"fused", [&] { stats = check.run(); }},
            {"G1", [&] { g1(grads); }},
            {"G2", [&] { g2(grads); }},
            {"G3", [&] { g3(grads); }},
            {"G5_sum", [&] { check.sum_baseline(); }}};
        at::Tensor found_inf, inv_scale, dst;
        if (cuda) {  // G4: the AMP unscale check, then G1
          found_inf = at::zeros({1}, d.flat.options().dtype(at::kFloat));
          inv_scale = at::ones({1}, d.flat.options().dtype(at::kFloat));
          methods.push_back({"G4", [&] {
                               at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
                                                                              inv_scale);
                               g1(grads);
                             }});
        } else {  // memcpy of the same bytes (read + write)
          dst = at::empty_like(d.flat);
          methods.push_back(
              {"memcpy", [&] { parallel_memcpy(dst.data_ptr(), d.flat.data_ptr(), d.bytes); }});
        }
        time_methods(methods, o.min_seconds, cuda);
        const double t_fused = methods[0].best, t_g1 = methods[1].best, t_g2 = methods[2].best,
                     t_g3 = methods[3].best, t_g5 = methods[4].best, t_other = methods[5].best;

        // Correctness of the timed fused result against fp64 _foreach_norm.
        GradCheckStats s = GradCheck::read(stats);
        auto ref_norms = at::_foreach_norm(grads, 2, at::kDouble);
        double ref = 0;
        bool ok = s.nonfinite == 0 && s.overflow_runs == 0;
        for (size_t i = 0; i < ref_norms.size(); ++i) {
          double r = ref_norms[i].item<double>();
          ref += r * r;
          ok = ok && std::abs(s.tensor_sumsq[i] - r * r) <= 1e-5 * r * r + 1e-30;
        }
        ok = ok && std::abs(s.sumsq - ref) <= 1e-5 * ref;
        all_ok = all_ok && ok;

        const double f = rate(t_fused);
        if (o.json) {
          json j = {{"device", dev.str()},
                    {"machine", machine},
                    {"layout", layout},
                    {"dtype", dt},
                    {"bytes", d.bytes},
                    {"tensors", d.grads.size()},
                    {"threads", at::get_num_threads()},
                    {"gbps",
                     {{"fused", f},
                      {"G1", rate(t_g1)},
                      {"G2", rate(t_g2)},
                      {"G3", rate(t_g3)},
                      {"G5_sum", rate(t_g5)},
                      {cuda ? "G4" : "memcpy", rate(t_other)}}},
                    {"ratio_fused_over",
                     {{"G1", t_g1 / t_fused},
                      {"G2", t_g2 / t_fused},
                      {"G3", t_g3 / t_fused},
                      {"G5_sum", t_g5 / t_fused},
                      {cuda ? "G4" : "memcpy", t_other / t_fused}}},
                    {"ok", ok}};
          if (cuda) {
            j["launches_per_check"] = kernels::kCudaCheckLaunches;
            j["host_syncs_per_check"] = kernels::kCudaCheckHostSyncs;
          }
          fmt::print("{}\n", j.dump());
        } else {
          fmt::print("{:<5} {:<5} {:>7} {:>6} | {:>7.2f} {:>7.2f} {:>7.2f} {:>7.2f} {:>7.2f} "
                     "{:>7.2f} | {:>6.2f} {:>6.2f} {:>6.1f} {:>6.1f} {:>6} | {}\n",
                     dt, layout, mb, d.grads.size(), f, rate(t_g1), rate(t_g2), rate(t_g3),
                     rate(t_other), rate(t_g5), t_g5 / t_fused, t_g1 / t_fused, t_g2 / t_fused,
                     t_g3 / t_fused, cuda ? fmt::format("{:.2f}", t_other / t_fused) : "",
                     ok ? "ok" : "MISMATCH");
        }
        std::fflush(stdout);
      }
  if (cuda && !o.json)
    fmt::print("fused check: {} kernel launch and {} host syncs per call (by construction)\n",
               kernels::kCudaCheckLaunches, kernels::kCudaCheckHostSyncs);
  return all_ok;
}

bool bench_comm(const CommBenchOptions& o) {
  const RankInfo ranks = discover_ranks();
  if (ranks.world_size < 2)
    throw ConfigError("bench comm measures collectives between ranks; launch it on several, e.g. "
                      "lockstep-run --nproc-per-node 2 -- lockstep bench comm");
  // NCCL moves GPU memory: the buffers live on this rank's GPU (cuda:LOCAL_RANK).
  if (o.backend == "nccl" && (!nccl_available() || !at::hasCUDA()))
    throw ConfigError("bench comm --backend nccl needs a CUDA build (launch/build_cuda.sh) and a "
                      "visible GPU; use --backend gloo or mpi on CPUs");
  const c10::Device device =
      o.backend == "nccl" ? resolve_device("cuda", ranks.local_rank) : c10::Device(c10::kCPU);
  CommOptions copt;
  copt.backend = o.backend;
  copt.cuda_device = device.is_cuda() ? device.index() : 0;
  std::unique_ptr<Comm> comm;
  if (o.backend == "mpi") {
#if LOCKSTEP_WITH_MPI
    comm = make_mpi_comm(ranks, copt);
#else
    throw ConfigError("bench comm --backend mpi: this build has no MPI (LOCKSTEP_MPI=OFF)");
#endif
  } else {
    comm = make_comm(ranks, copt);
  }
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const int w = ranks.world_size, r = ranks.rank;
  const bool lead = r == 0;
  if (lead && !o.json)
    fmt::print("lockstep bench comm | {} ranks ({}) | backend {} | fp32 on {} | {} iterations "
               "after {} warm-up\n{:<14} {:>12} {:>11} {:>10} {:>10} | {}\n",
               w, ranks.launcher, comm->backend(), device.str(), o.iters, o.warmup,
               "op", "bytes", "time_us", "algbw_GBs", "busbw_GBs", "check");
  bool all_ok = true;
  for (const auto& op : o.ops) {
    // nccl-tests' conventions: the size is the whole buffer (all_gather's output,
    // reduce_scatter's input, w blocks), and these bus bandwidth factors.
    const bool blocked = op == "all_gather" || op == "reduce_scatter";
    const double factor = op == "all_reduce" ? 2.0 * (w - 1) / w
                          : blocked          ? static_cast<double>(w - 1) / w
                                             : 1.0;
    for (int64_t bytes : o.sizes_bytes) {
      const int64_t block = std::max<int64_t>(1, bytes / 4 / (blocked ? w : 1));
      const int64_t n = blocked ? block * w : block;  // elements of the whole buffer
      at::Tensor t = at::empty({n}, fp32);
      at::Tensor piece = at::empty({block}, fp32);
      at::Tensor gathered = at::empty({w, block}, fp32);
      bool ok = true;
      double best = 1e30;
      for (int it = 0; it < o.warmup + o.iters; ++it) {
        // Small integers: sums are exact in fp32, so the check is exact too.
        t.fill_(static_cast<double>(r + 1 + it % 3));
        piece.fill_(static_cast<double>(r + 1 + it % 3));
        const auto start = Clock::now();
        if (op == "all_reduce")
          comm->all_reduce_sum(t);
        else if (op == "reduce_scatter")
          comm->reduce_scatter_sum(t, piece);
        else if (op == "all_gather")
          comm->all_gather(piece, gathered);
        else
          comm->broadcast(t, 0);
        const double secs = std::chrono::duration<double>(Clock::now() - start).count();
        if (it >= o.warmup) best = std::min(best, secs);
        const double k = it % 3;
        if (op == "all_reduce")
          ok = ok && at::eq(t, w * (w + 1) / 2.0 + w * k).all().item<bool>();
        else if (op == "reduce_scatter")
          ok = ok && at::eq(piece, w * (w + 1) / 2.0 + w * k).all().item<bool>();
        else if (op == "broadcast")
          ok = ok && at::eq(t, 1.0 + k).all().item<bool>();
        else
          for (int q = 0; q < w; ++q)
            ok = ok && at::eq(gathered.select(0, q), q + 1 + k).all().item<bool>();
      }
      // Every rank's verdict counts: gather them (an all-reduce of the failures).
      at::Tensor bad = at::full({1}, ok ? 0.0 : 1.0, at::kFloat);
      comm->all_reduce_sum(bad);
      const bool agreed_ok = bad.item<float>() == 0.0f;
      all_ok = all_ok && agreed_ok;
      const double algbw = static_cast<double>(n * 4) / best / 1e9;
      if (lead) {
        if (o.json)
          fmt::print("{}\n", json{{"op", op},
                                  {"bytes", n * 4},
                                  {"ranks", w},
                                  {"time_us", best * 1e6},
                                  {"algbw_GBps", algbw},
                                  {"busbw_GBps", algbw * factor},
                                  {"ok", agreed_ok}}
                                  .dump());
        else
          fmt::print("{:<14} {:>12} {:>11.1f} {:>10.3f} {:>10.3f} | {}\n", op, n * 4, best * 1e6,
                     algbw, algbw * factor, agreed_ok ? "ok" : "WRONG");
        std::fflush(stdout);
      }
    }
  }
  return all_ok;
}

}  // namespace lockstep
