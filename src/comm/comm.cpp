#include "comm/comm.h"

#include <ATen/ops/empty.h>

#include <cstring>

namespace lockstep {

std::vector<std::vector<double>> all_gather_values(Comm* comm, const std::vector<double>& mine) {
  if (!comm || comm->size() == 1) return {mine};
  const auto n = static_cast<int64_t>(mine.size());
  at::Tensor in = at::empty({n}, at::kDouble);
  std::memcpy(in.data_ptr<double>(), mine.data(), sizeof(double) * mine.size());
  const c10::Device device = comm->device();
  at::Tensor out = at::empty({comm->size(), n}, in.options().device(device));
  comm->all_gather(device.is_cpu() ? in : in.to(device), out);
  const at::Tensor host = device.is_cpu() ? out : out.cpu();
  std::vector<std::vector<double>> all;
  for (int r = 0; r < comm->size(); ++r) {
    const double* q = host.select(0, r).data_ptr<double>();
    all.emplace_back(q, q + n);
  }
  return all;
}

}  // namespace lockstep
