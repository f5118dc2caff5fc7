// `lockstep bench agree`: the ranks of a real job (under a launcher, any backend) run the step's
// pipeline on synthetic gradients — check [A] of their own gradient, the gradient all-reduce,
// check [B] of their shard, the stats exchange and the decision — with faults injected on
// random ranks and steps, and compare what they decided at every step (a digest of the
// verdict, all-gathered). Agreement by construction, shown at a world size a CI machine runs.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/ops/randn.h>
#include <c10/core/GradMode.h>
#include <fmt/core.h>

#include <chrono>
#include <cmath>
#include <cstring>

#include "bench/machine.h"
#include "check/gradcheck.h"
#include "comm/comm.h"
#include "decide/detector.h"
#include "decide/exchange.h"
#include "decide/record.h"
#include "lockstep/bench.h"
#include "ranks.h"
#include "runtime.h"
#include "splitmix.h"

namespace lockstep {
namespace {

using Clock = std::chrono::steady_clock;

enum class Fault { kNone, kNanGrad, kSpike, kGlobalSpike, kNanLoss };

// The step's fault and its rank, the same on every rank: about one step in four once the
// windows hold skip.min_history steps (before, a spike is taken and widens them).
std::pair<Fault, int> fault_at(int64_t step, int world, uint64_t seed) {
  const uint64_t h = splitmix64(splitmix64(seed) + static_cast<uint64_t>(step));
  const int pick = static_cast<int>(h % 16);
  const int rank = static_cast<int>(splitmix64(h) % static_cast<uint64_t>(world));
  if (step <= SkipConfig{}.min_history || pick >= 4) return {Fault::kNone, -1};
  return {static_cast<Fault>(pick + 1), rank};
}

// What this rank contributes to step `step`: its synthetic gradient (scaled by a fault),
// checked before and after the all-reduce, and its loss.
RankStats contribute(Comm& comm, int64_t step, int64_t per_rank, uint64_t seed, Fault fault,
                     int at) {
  const int w = comm.size(), r = comm.rank();
  at::Generator gen = at::detail::createCPUGenerator(
      splitmix64(seed + static_cast<uint64_t>(step) * 1000003ULL + static_cast<uint64_t>(r)));
  at::Tensor g = at::randn({per_rank * w}, gen).mul_(0.01);
  const bool mine = at == r;
  if (fault == Fault::kGlobalSpike) g.mul_(50.0);
  if (mine && fault == Fault::kSpike) g.mul_(100.0);
  if (mine && fault == Fault::kNanGrad) g.narrow(0, step % g.numel(), 1).fill_(std::nan(""));
  GradCheck own({{"gradient", g}});
  const GradCheckStats local = GradCheck::read(own.run());
  at::Tensor synced = g.clone();
  comm.all_reduce_sum(synced);
  synced.div_(static_cast<double>(w));
  GradCheck shard({{"gradient", synced}}, r * per_rank, per_rank);
  const double loss =
      mine && fault == Fault::kNanLoss ? std::nan("") : 3.0 + 0.001 * static_cast<double>(step % 7);
  return rank_stats(local, GradCheck::read(shard.run()), loss, {loss}, false);
}

// The verdict as 52 bits (exact as a double in the all-gather).
double digest_of(int64_t step, const Verdict& v) {
  uint64_t h = splitmix64(static_cast<uint64_t>(step));
  const auto mix = [&h](uint64_t x) { h = splitmix64(h ^ x); };
  uint64_t bits = 0;
  std::memcpy(&bits, &v.grad_norm, sizeof bits);
  mix(bits);
  std::memcpy(&bits, &v.clip, sizeof bits);
  mix(bits);
  mix(static_cast<uint64_t>(v.decision));
  mix(v.reasons);
  mix(static_cast<uint64_t>(v.why));
  mix(static_cast<uint64_t>(v.scope));
  for (int c : v.culprit_ranks) mix(static_cast<uint64_t>(c));
  return static_cast<double>(h >> 12);
}

struct Tally {
  int64_t steps = 0, faults = 0, first_disagreement = -1;
  int64_t by_decision[5] = {};
  double exchange_s = 0, decide_s = 0;
  double record_s = 0;  // the record form: its all-reduces and its decision
  int64_t counted = 0, first_record_difference = -1;
};

// The record form's decision is the table's (the numbers the trainer acts on, bit for bit).
bool same_decision(const core::DecideResult& r, const Verdict& v) {
  const core::DecideResult t = result_of(v);
  return r.outcome == t.outcome && r.clipped == t.clipped && r.why == t.why &&
         r.reasons == t.reasons && std::memcmp(&r.grad_norm, &v.grad_norm, 8) == 0 &&
         std::memcmp(&r.loss, &v.loss, 8) == 0 && std::memcmp(&r.clip, &v.clip, 8) == 0;
}

}  // namespace

bool bench_agree(const AgreeBenchOptions& o) {
  const RankInfo ranks = discover_ranks();
  at::set_num_threads(1);
  const c10::AutoGradMode no_grad(false);
  const std::unique_ptr<Comm> comm =
      connect(ranks, o.backend, c10::Device(c10::kCPU), CommConfig{});
  const int w = comm->size(), r = comm->rank();
  SkipConfig skip;
  skip.enabled = true;  // and the default policy: a global spike is clipped
  skip.max_consecutive = 0;  // the guards would end the run at the first burst of faults
  skip.max_fraction = 0;
  if (r == o.disagree_rank) skip.grad_norm_zscore = 0;  // the comparison's self-test
  SkipDetector detector(skip, TrainingConfig{}, w);
  RecordDecider record(detector.config(), skip.window, skip.fraction_window, 1.0);
  Tally t;
  for (int64_t step = 1; step <= o.steps; ++step) {
    const auto [fault, at] = fault_at(step, w, o.seed);
    t.faults += fault != Fault::kNone ? 1 : 0;
    const RankStats mine = contribute(*comm, step, o.gradient_per_rank, o.seed, fault, at);
    auto start = Clock::now();
    const std::vector<RankStats> table = exchange_stats(mine, comm.get());
    t.exchange_s += std::chrono::duration<double>(Clock::now() - start).count();
    start = Clock::now();
    const Verdict v = detector.decide(table);
    detector.record(v);
    t.decide_s += std::chrono::duration<double>(Clock::now() - start).count();
    ++t.by_decision[static_cast<int>(v.decision)];
    start = Clock::now();
    const RecordStep rs = record.decide(mine, false, core::BeforeSync{}, comm.get());
    t.record_s += std::chrono::duration<double>(Clock::now() - start).count();
    t.counted += rs.counted ? 1 : 0;
    if (!same_decision(rs.result, v) && t.first_record_difference < 0)
      t.first_record_difference = step;
    const auto digests = all_gather_values(comm.get(), {digest_of(step, v)});
    for (const auto& d : digests)
      if (d.at(0) != digests[0].at(0) && t.first_disagreement < 0) t.first_disagreement = step;
    ++t.steps;
  }
  if (r == 0) {
    fmt::print("lockstep bench agree | {} | {} ranks over {} | {} steps, a synthetic gradient of "
               "{} fp32 ({} checked by each rank), faults on {} steps (nan_grad, spike, global "
               "spike, nan_loss on random ranks)\n",
               describe_machine(false), w, comm->backend(), t.steps, o.gradient_per_rank * w,
               o.gradient_per_rank, t.faults);
    fmt::print("decided: {} step, {} skip, {} clip, {} abort; rank 0's stats exchange {:.2f} ms "
               "and decision {:.1f} us per step ({} processes on this machine)\n",
               t.by_decision[static_cast<int>(Decision::kStep)],
               t.by_decision[static_cast<int>(Decision::kSkip)],
               t.by_decision[static_cast<int>(Decision::kClip)],
               t.by_decision[static_cast<int>(Decision::kAbort)], 1e3 * t.exchange_s / t.steps,
               1e6 * t.decide_s / t.steps, w);
    if (t.first_disagreement < 0)
      fmt::print("every rank decided the same at every step (a digest of each verdict compared "
                 "across the {} ranks each step)\n",
                 w);
    else
      fmt::print("the ranks decided differently at step {}\n", t.first_disagreement);
  }
  // The record form on every rank: its own windows, one {} B record all-reduced per step.
  const std::vector<std::vector<double>> firsts =
      all_gather_values(comm.get(), {static_cast<double>(t.first_record_difference)});
  int64_t record_differs = -1;
  for (const auto& f : firsts)
    if (f.at(0) >= 0 && (record_differs < 0 || f.at(0) < record_differs))
      record_differs = static_cast<int64_t>(f.at(0));
  if (r == 0) {
    fmt::print("record form (each rank its own windows, a {} B record all-reduced, a count on {} "
               "steps): rank 0's exchange and decision {:.2f} ms per step\n",
               RecordDecider::kExchangedBytes, t.counted, 1e3 * t.record_s / t.steps);
    if (record_differs < 0)
      fmt::print("the record form decided as the table at every step on every rank\n");
    else
      fmt::print("the record form decided otherwise than the table at step {}\n",
                 record_differs);
  }
  return t.first_disagreement < 0 && record_differs < 0;
}

}  // namespace lockstep
