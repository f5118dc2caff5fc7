#include "comm/comm.h"

#include <ATen/ops/empty.h>

#include <cstring>

namespace lockstep {

std::vector<std::vector<double>> all_gather_values(Comm* comm, const std::vector<double>& mine) {
  if (!comm || comm->size() == 1) return {mine};
  const auto n = static_cast<int64_t>(mine.size());
  const c10::Device device = comm->device();
  // For a GPU: the row goes up asynchronously from pinned memory; only the result's read waits.
  const auto host_options = at::TensorOptions().dtype(at::kDouble);
  at::Tensor in = at::empty({n}, host_options.pinned_memory(device.is_cuda()));
  std::memcpy(in.data_ptr<double>(), mine.data(), sizeof(double) * mine.size());
  at::Tensor out = at::empty({comm->size(), n}, host_options.device(device));
  comm->all_gather(device.is_cpu() ? in : in.to(device, /*non_blocking=*/true), out);
  const at::Tensor host = device.is_cpu() ? out : out.cpu();
  std::vector<std::vector<double>> all;
  for (int r = 0; r < comm->size(); ++r) {
    const double* q = host.select(0, r).data_ptr<double>();
    all.emplace_back(q, q + n);
  }
  return all;
}

}  // namespace lockstep
