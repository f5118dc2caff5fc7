// `lockstep bench gradcheck`, `lockstep bench comm` and `lockstep bench decision`: measured in
// the same run against the baselines, correctness checked on every timed run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/config.h"  // Backend

namespace lockstep {

struct GradcheckBenchOptions {
  std::vector<int64_t> sizes_mb = {1, 16, 256, 1024};
  std::vector<std::string> layouts = {"few", "many"};  // 8 large tensors | 10,000 small ones
  std::vector<std::string> dtypes = {"fp32", "bf16"};
  std::string device = "cpu";  // cpu | cuda
  int threads = 2;
  double min_seconds = 0.5;  // per method and size, split over 5 interleaved rounds
  bool json = false;
};

// Prints a table (or one JSON object per measurement) to stdout. Returns false if any fused
// result disagreed with the reference.
bool bench_gradcheck(const GradcheckBenchOptions& options);

struct CommBenchOptions {
  std::vector<int64_t> sizes_bytes = {1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24};
  std::vector<std::string> ops = {"all_reduce", "reduce_scatter", "all_gather",
                                   "broadcast"};
  int warmup = 2;
  int iters = 10;
  bool json = false;
  Backend backend = Backend::kGloo;  // gloo | mpi | nccl (tensors on the rank's GPU)
};

// `lockstep bench comm`: run under a launcher (lockstep-run, torchrun, mpirun). Rank 0 prints a
// size sweep per collective with time, algbw and busbw (nccl-tests' bus factors); every timed
// iteration's result is checked against the exact expected values. Returns false on a wrong
// result on any rank.
bool bench_comm(const CommBenchOptions& options);

struct DecisionBenchOptions {
  std::vector<int> worlds = {1, 2, 4, 8, 64, 1024};
  int steps = 2000;
};

// `lockstep bench decision`: the cost of one step decision (host detector and the device's
// form of it, computed on the host), the bytes each rank exchanges and the decision's memory
// per rank, per world size. Returns false if the two forms ever disagreed.
bool bench_decision(const DecisionBenchOptions& options);

struct AgreeBenchOptions {
  int64_t steps = 200;
  int64_t gradient_per_rank = 1024;
  uint64_t seed = 1;
  Backend backend = Backend::kGloo;
  int disagree_rank = -1;  // a self-test: this rank decides without the norm z-score
};

// `lockstep bench agree`: run under a launcher; every rank runs the step's checks, gradient
// all-reduce, stats exchange and decision on synthetic gradients with random faults, and the
// ranks compare their verdicts each step. Returns false if any two ever differed.
bool bench_agree(const AgreeBenchOptions& options);

}  // namespace lockstep
