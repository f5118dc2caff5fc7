#include "comm/comm.h"

#include <ATen/ops/empty.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

namespace lockstep {

at::Tensor all_gather_rows(Comm* comm, const at::Tensor& row) {
  return gather_rows(comm, row).cpu();
}

at::Tensor gather_rows(Comm* comm, const at::Tensor& row) {
  if (!comm || comm->size() == 1) return row.reshape({1, -1});
  const c10::Device device = comm->device();
  at::Tensor out = at::empty({comm->size(), row.numel()}, row.options().device(device));
  // A pinned host row goes up to a GPU asynchronously (all_gather_values' is: the copy is
  // ordered before the collective on the stream). A GPU row for a host backend (Gloo on a GPU
  // run) comes down with a blocking copy: Gloo reads host memory at once, and an asynchronous
  // copy into pinned memory may not have landed by then (on the lent H200, two ranks over Gloo
  // saw a NaN gradient named a step late).
  const bool up = row.is_cpu() && !device.is_cpu();
  comm->all_gather(row.device() == device ? row : row.to(device, /*non_blocking=*/up), out);
  return out;
}

std::vector<std::vector<double>> all_gather_values(Comm* comm, const std::vector<double>& mine) {
  if (!comm || comm->size() == 1) return {mine};
  const auto n = static_cast<int64_t>(mine.size());
  const bool pinned = comm->device().is_cuda();
  at::Tensor in = at::empty({n}, at::TensorOptions().dtype(at::kDouble).pinned_memory(pinned));
  std::memcpy(in.data_ptr<double>(), mine.data(), sizeof(double) * mine.size());
  const at::Tensor host = all_gather_rows(comm, in);
  std::vector<std::vector<double>> all;
  for (int r = 0; r < comm->size(); ++r) {
    const double* q = host.select(0, r).data_ptr<double>();
    all.emplace_back(q, q + n);
  }
  return all;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    parts.push_back(j > i ? fmt::format("{}-{}", ranks[i], ranks[j]) : fmt::format("{}", ranks[i]));
    i = j + 1;
  }
  return fmt::format("rank{} {}", ranks.size() > 1 ? "s" : "", fmt::join(parts, ", "));
}

double roll_call_seconds(double timeout_seconds) {
  return std::clamp(timeout_seconds / 2, 0.5, 15.0);
}

std::string stalled_ranks_words(const std::vector<int>& missing, double window_seconds) {
  if (missing.empty())
    return "every rank timed out here too (none is lost: a collective out of step, or a network "
           "slower than comm.train_timeout_seconds?)";
  return fmt::format("{} did not arrive within {:g} s of this rank's timeout (stopped or dead: {} "
                     "stopped answering)",
                     rank_list(missing), window_seconds, missing.size() > 1 ? "they" : "it");
}

}  // namespace lockstep
