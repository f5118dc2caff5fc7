// `lockstep bench gradcheck`: the fused gradient check against the ways people check today,
// measured in the same run, correctness checked on every timed run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

}  // namespace lockstep
