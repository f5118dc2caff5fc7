// The reference for the fused gradient check, built from stock ATen ops: exact nonfinite counts
// from isfinite, sums of squares of the finite elements from _foreach_norm in fp64.
#pragma once

#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "check/gradcheck.h"

namespace lockstep::test {

inline GradCheckStats reference_stats(const std::vector<NamedTensor>& grads, int64_t offset = 0,
                                      int64_t length = -1) {
  int64_t total = 0;
  for (const auto& g : grads) total += g.tensor.numel();
  const int64_t end = length < 0 ? total : std::min(total, offset + length);
  GradCheckStats s;
  std::vector<at::Tensor> finite;
  int64_t base = 0;
  for (const auto& g : grads) {
    const int64_t n = g.tensor.numel();
    const int64_t lo = std::max(base, offset), hi = std::min(base + n, end);
    at::Tensor part = g.tensor.reshape({-1}).narrow(0, hi > lo ? lo - base : 0,
                                                     hi > lo ? hi - lo : 0);
    at::Tensor ok = at::isfinite(part);
    s.tensor_nonfinite.push_back(static_cast<double>(ok.logical_not().sum().item<int64_t>()));
    finite.push_back(at::where(ok, part, at::zeros_like(part)).to(at::kDouble));
    base += n;
  }
  auto norms = at::_foreach_norm(finite, 2, at::kDouble);
  for (size_t i = 0; i < grads.size(); ++i) {
    double nrm = norms[i].item<double>();
    s.tensor_sumsq.push_back(nrm * nrm);
    s.nonfinite += s.tensor_nonfinite[i];
    s.sumsq += nrm * nrm;
  }
  return s;
}

// Counts must be exact; sums of squares agree to fp32-run rounding.
inline void expect_matches(const GradCheckStats& got, const GradCheckStats& want,
                           double rel = 2e-6) {
  ASSERT_EQ(got.tensor_sumsq.size(), want.tensor_sumsq.size());
  EXPECT_EQ(got.nonfinite, want.nonfinite);
  EXPECT_NEAR(got.sumsq, want.sumsq, rel * want.sumsq + 1e-300) << "total";
  for (size_t i = 0; i < want.tensor_sumsq.size(); ++i) {
    EXPECT_EQ(got.tensor_nonfinite[i], want.tensor_nonfinite[i]) << "tensor " << i;
    EXPECT_NEAR(got.tensor_sumsq[i], want.tensor_sumsq[i], rel * want.tensor_sumsq[i] + 1e-300)
        << "tensor " << i;
  }
}

inline std::vector<NamedTensor> random_grads(const std::vector<int64_t>& sizes,
                                             at::ScalarType dtype, c10::Device device) {
  std::vector<NamedTensor> out;
  for (size_t i = 0; i < sizes.size(); ++i)
    out.push_back({"g" + std::to_string(i),
                   at::randn({sizes[i]}, at::TensorOptions().dtype(at::kFloat))
                       .to(dtype)
                       .to(device)});
  return out;
}

// What an overflow run is, the same on every device: kernels::kRunElems elements of a segment
// cut from its start, counted once when its partial sums overflow. Two tensors: in the first,
// two huge values share run 0 and a third sits in run 2; in the second, one in run 0. `huge`:
// a value whose square overflows the accumulation (1e30 for fp32 partials, 1e200 for fp64).
// Three overflow runs.
inline std::vector<NamedTensor> overflow_runs_case(c10::Device device, at::ScalarType dtype,
                                                   double huge) {
  const int64_t run = kernels::kRunElems;
  at::Tensor a = at::zeros({3 * run + 100}, at::TensorOptions().dtype(dtype));
  at::Tensor b = at::zeros({run + 5}, at::TensorOptions().dtype(dtype));
  a.select(0, 5).fill_(huge);
  a.select(0, 100).fill_(-huge);
  a.select(0, 2 * run + 7).fill_(huge);
  b.select(0, 3).fill_(huge);
  return {{"a", a.to(device)}, {"b", b.to(device)}};
}
constexpr double kOverflowRunsInCase = 3;

}  // namespace lockstep::test
