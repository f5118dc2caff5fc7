// `lockstep bench comm`: nccl-tests' sweep of collective sizes over the job's communicator,
// every timed result checked on every rank.
#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/eq.h>
#include <ATen/ops/full.h>
#include <fmt/core.h>

#include <chrono>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "lockstep/bench.h"
#include "lockstep/error.h"
#include "ranks.h"
#include "runtime.h"

namespace lockstep {
namespace {

using Clock = std::chrono::steady_clock;

// The buffers of one (op, size), filled with small integers so that sums are exact in fp32.
struct Buffers {
  at::Tensor whole, piece, gathered;
  int64_t bytes = 0;  // nccl-tests' size: the whole buffer (all_gather's output,
                      // reduce_scatter's input: w blocks)
};

Buffers buffers(const std::string& op, int64_t bytes, int w, c10::Device device) {
  const bool blocked = op == "all_gather" || op == "reduce_scatter";
  const int64_t block = std::max<int64_t>(1, bytes / 4 / (blocked ? w : 1));
  const int64_t n = blocked ? block * w : block;  // elements of the whole buffer
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  return {at::empty({n}, fp32), at::empty({block}, fp32), at::empty({w, block}, fp32), n * 4};
}

// One timed call; returns its seconds and whether this rank's result is exact.
std::pair<double, bool> run_once(Comm& comm, const std::string& op, Buffers& b, int it) {
  const int w = comm.size(), r = comm.rank();
  b.whole.fill_(static_cast<double>(r + 1 + it % 3));
  b.piece.fill_(static_cast<double>(r + 1 + it % 3));
  const auto start = Clock::now();
  if (op == "all_reduce")
    comm.all_reduce_sum(b.whole);
  else if (op == "reduce_scatter")
    comm.reduce_scatter_sum(b.whole, b.piece);
  else if (op == "all_gather")
    comm.all_gather(b.piece, b.gathered);
  else
    comm.broadcast(b.whole, 0);
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  const double k = it % 3, sum = w * (w + 1) / 2.0 + w * k;
  bool ok = true;
  if (op == "all_reduce")
    ok = at::eq(b.whole, sum).all().item<bool>();
  else if (op == "reduce_scatter")
    ok = at::eq(b.piece, sum).all().item<bool>();
  else if (op == "broadcast")
    ok = at::eq(b.whole, 1.0 + k).all().item<bool>();
  else
    for (int q = 0; q < w; ++q) ok = ok && at::eq(b.gathered.select(0, q), q + 1 + k).all().item<bool>();
  return {secs, ok};
}

void print_row(const CommBenchOptions& o, const std::string& op, int64_t bytes, int w, double best,
               bool ok) {
  // nccl-tests' bus bandwidth factors.
  const bool blocked = op == "all_gather" || op == "reduce_scatter";
  const double factor = op == "all_reduce" ? 2.0 * (w - 1) / w
                        : blocked          ? static_cast<double>(w - 1) / w
                                           : 1.0;
  const double algbw = static_cast<double>(bytes) / best / 1e9;
  if (o.json)
    fmt::print("{}\n", nlohmann::json{{"op", op},
                                      {"bytes", bytes},
                                      {"ranks", w},
                                      {"time_us", best * 1e6},
                                      {"algbw_GBps", algbw},
                                      {"busbw_GBps", algbw * factor},
                                      {"ok", ok}}
                           .dump());
  else
    fmt::print("{:<14} {:>12} {:>11.1f} {:>10.3f} {:>10.3f} | {}\n", op, bytes, best * 1e6, algbw,
               algbw * factor, ok ? "ok" : "WRONG");
  std::fflush(stdout);
}

}  // namespace

bool bench_comm(const CommBenchOptions& o) {
  const RankInfo ranks = discover_ranks();
  if (ranks.world_size < 2)
    throw ConfigError("bench comm measures collectives between ranks; launch it on several, e.g. "
                      "lockstep-run --nproc-per-node 2 -- lockstep bench comm");
  // NCCL moves GPU memory: the buffers live on this rank's GPU (cuda:LOCAL_RANK).
  const bool nccl = o.backend == Backend::kNccl;
  if (nccl && (!nccl_available() || !at::hasCUDA()))
    throw ConfigError("bench comm --backend nccl needs a CUDA build (launch/build_cuda.sh) and a "
                      "visible GPU; use --backend gloo or mpi on CPUs");
  const c10::Device device = resolve_device(nccl ? DeviceKind::kCuda : DeviceKind::kCpu,
                                            ranks.local_rank);
  const std::unique_ptr<Comm> comm = connect(ranks, o.backend, device, CommConfig{});
  const int w = ranks.world_size;
  const bool lead = ranks.rank == 0;
  if (lead && !o.json)
    fmt::print("lockstep bench comm | {} ranks ({}) | backend {} | fp32 on {} | {} iterations "
               "after {} warm-up\n{:<14} {:>12} {:>11} {:>10} {:>10} | {}\n",
               w, ranks.launcher, comm->backend(), device.str(), o.iters, o.warmup, "op", "bytes",
               "time_us", "algbw_GBs", "busbw_GBs", "check");
  bool all_ok = true;
  for (const auto& op : o.ops)
    for (int64_t size : o.sizes_bytes) {
      Buffers b = buffers(op, size, w, device);
      bool ok = true;
      double best = 1e30;
      for (int it = 0; it < o.warmup + o.iters; ++it) {
        const auto [secs, right] = run_once(*comm, op, b, it);
        if (it >= o.warmup) best = std::min(best, secs);
        ok = ok && right;
      }
      // Every rank's verdict counts: an all-reduce of the failures.
      at::Tensor bad = at::full({1}, ok ? 0.0 : 1.0, at::kFloat);
      comm->all_reduce_sum(bad);
      const bool agreed_ok = bad.item<float>() == 0.0f;
      all_ok = all_ok && agreed_ok;
      if (lead) print_row(o, op, b.bytes, w, best, agreed_ok);
    }
  return all_ok;
}

}  // namespace lockstep
