#include "check/gradcheck.h"

#ifdef LOCKSTEP_WITH_CUDA
#include "check/gradcheck_cuda.h"
#endif

#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <fmt/core.h>

// map_blocks' at::parallel_for (and the bench's) would quietly run on one thread.
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "lockstep_core must be compiled with OpenMP (CMake: OpenMP::OpenMP_CXX) when ATen uses it"
#endif

#include <algorithm>
#include <stdexcept>
#include <utility>
#include <vector>

namespace lockstep {

namespace {

// CPU work unit: a multiple of the fp32 run length, so run boundaries (and so the bits of the
// result) depend only on the segment table, never on the thread count.
constexpr int64_t kBlockElems = 4 * kernels::kRunElems;

kernels::DType to_kernel_dtype(const NamedTensor& t) {
  switch (t.tensor.scalar_type()) {
    case at::kFloat: return kernels::DType::kF32;
    case at::kBFloat16: return kernels::DType::kBF16;
    case at::kHalf: return kernels::DType::kF16;
    case at::kDouble: return kernels::DType::kF64;
    default:
      throw std::invalid_argument(fmt::format(
          "gradient check: tensor '{}' has dtype {}; supported: float32, bfloat16, float16, "
          "float64",
          t.name, c10::toString(t.tensor.scalar_type())));
  }
}

// fn(block) for every block over ATen's thread pool; results in block order.
template <typename R, typename F>
std::vector<R> map_blocks(const std::vector<kernels::Segment>& blocks, F&& fn) {
  std::vector<R> out(blocks.size());
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) out[b] = fn(blocks[b]);
  });
  return out;
}

// Ascending indices grouped into runs of adjacent ones, as [first, last).
[[maybe_unused]] std::vector<std::pair<int, int>> runs_of(const std::vector<int64_t>& which) {
  std::vector<std::pair<int, int>> runs;
  for (int64_t b : which) {
    if (!runs.empty() && runs.back().second == b) ++runs.back().second;
    else runs.emplace_back(static_cast<int>(b), static_cast<int>(b) + 1);
  }
  return runs;
}

}  // namespace

#ifndef LOCKSTEP_WITH_CUDA
struct GradCheck::Cuda {};
#endif

GradCheck::GradCheck(std::vector<NamedTensor> grads, int64_t offset, int64_t length)
    : grads_(std::move(grads)), offset_(offset), length_(length) {
  if (offset_ < 0) throw std::invalid_argument("gradient check: negative shard offset");
  build_table();
}

GradCheck::~GradCheck() = default;

void GradCheck::build_table() {
  segments_.clear();
  blocks_.clear();
  block_start_.clear();
  std::vector<int64_t> segment_start;  // each segment's first element in the concatenation
  if (grads_.empty()) throw std::invalid_argument("gradient check: no tensors");
  const c10::Device device = grads_[0].tensor.device();
  int64_t total = 0;
  for (const auto& g : grads_) total += g.tensor.numel();
  const int64_t end = length_ < 0 ? total : std::min(total, offset_ + length_);

  int64_t base = 0;  // first element of tensor i in the concatenation
  for (size_t i = 0; i < grads_.size(); ++i) {
    const NamedTensor& g = grads_[i];
    const kernels::DType dtype = to_kernel_dtype(g);
    if (g.tensor.device() != device)
      throw std::invalid_argument(fmt::format(
          "gradient check: tensor '{}' is on {}, the first tensor on {}; all must share a device",
          g.name, g.tensor.device().str(), device.str()));
    if (g.tensor.layout() != at::kStrided || !g.tensor.is_contiguous())
      throw std::invalid_argument(fmt::format(
          "gradient check: tensor '{}' is not a dense contiguous tensor; pass .contiguous() "
          "gradients or a flat buffer's views",
          g.name));
    const int64_t n = g.tensor.numel();
    const int64_t lo = std::max(base, offset_), hi = std::min(base + n, end);
    if (hi > lo) {
      auto ptr = static_cast<const char*>(g.tensor.const_data_ptr()) +
                 (lo - base) * kernels::dtype_size(dtype);
      segments_.push_back({ptr, hi - lo, static_cast<int32_t>(i), dtype});
      segment_start.push_back(lo);
    }
    base += n;
  }
  pointers_.clear();
  for (const auto& g : grads_) pointers_.push_back(g.tensor.const_data_ptr());
  // The units checked alone (run_range): on the CPU blocks of a few runs, on CUDA the plan's
  // chunks (one run each, cut the same way, so block b is chunk b).
  const int64_t unit = device.is_cuda() ? kernels::kRunElems : kBlockElems;
  for (size_t k = 0; k < segments_.size(); ++k) {
    const kernels::Segment& seg = segments_[k];
    for (int64_t start = 0; start < seg.count; start += unit) {
      blocks_.push_back({static_cast<const char*>(seg.ptr) + start * kernels::dtype_size(seg.dtype),
                         std::min(unit, seg.count - start), seg.tensor, seg.dtype});
      block_start_.push_back(segment_start[k] + start);
    }
  }
  partial_.assign(blocks_.size(), {});
  done_.assign(blocks_.size(), 0);

  const auto size = kernels::stats_size(num_tensors());
  out_ = at::empty({size}, grads_[0].tensor.options().dtype(at::kDouble));
  cuda_.reset();
#ifdef LOCKSTEP_WITH_CUDA
  if (device.is_cuda()) {
    cuda_ = Cuda::create(segments_, num_tensors(), device.index());
    if (cuda_->chunks() != static_cast<int>(blocks_.size()))
      throw std::logic_error(fmt::format("gradient check: the CUDA plan has {} chunks, the table "
                                         "{} blocks",
                                         cuda_->chunks(), blocks_.size()));
  }
#endif
}

void GradCheck::check_pointers() const {
  for (size_t i = 0; i < grads_.size(); ++i)
    if (grads_[i].tensor.const_data_ptr() != pointers_[i])
      throw std::logic_error(fmt::format(
          "gradient check: the memory of tensor '{}' moved since the check was built (its "
          "storage was replaced); build the check again over the tensors as they are now",
          grads_[i].name));
}

at::Tensor GradCheck::run() {
  check_pointers();  // the plan holds raw pointers: a moved tensor would be read stale
  if (!cuda_ && !out_.is_cpu())
    throw std::invalid_argument("gradient check: this build has no CUDA support for " +
                                out_.device().str());
  std::vector<int64_t> rest;  // the blocks no run_range has checked this step
  for (size_t b = 0; b < blocks_.size(); ++b)
    if (!done_[b]) rest.push_back(static_cast<int64_t>(b));
  checked_early_ = static_cast<int64_t>(blocks_.size() - rest.size());
#ifdef LOCKSTEP_WITH_CUDA
  if (cuda_) {  // the rest's runs of chunks early but the last, which the reducing launch takes
    const auto runs = runs_of(rest);
    for (size_t i = 0; i + 1 < runs.size(); ++i) cuda_->run_early(runs[i].first, runs[i].second);
    const auto last = runs.empty() ? std::pair<int, int>(0, 0) : runs.back();
    cuda_->run(out_.data_ptr<double>(), last.first, last.second);
    std::fill(done_.begin(), done_.end(), 0);
    return out_;
  }
#endif
  check_blocks(rest);
  std::fill(done_.begin(), done_.end(), 0);
  // Fixed-order reduction: blocks in table order into tensors, tensors in order into totals.
  double* out = out_.data_ptr<double>();
  std::fill(out, out + out_.numel(), 0.0);
  double overflow = 0;
  for (size_t b = 0; b < blocks_.size(); ++b) {
    const int t = blocks_[b].tensor;
    out[kernels::kStatsHeader + 2 * t] += static_cast<double>(partial_[b].nonfinite);
    out[kernels::kStatsHeader + 2 * t + 1] += partial_[b].sumsq;
    overflow += static_cast<double>(partial_[b].overflow_runs);
  }
  for (int t = 0; t < num_tensors(); ++t) {
    out[0] += out[kernels::kStatsHeader + 2 * t];
    out[1] += out[kernels::kStatsHeader + 2 * t + 1];
  }
  out[2] = overflow;
  return out_;
}

void GradCheck::check_blocks(const std::vector<int64_t>& which) {
  at::parallel_for(0, static_cast<int64_t>(which.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const kernels::Segment& b = blocks_[which[i]];
      partial_[which[i]] = kernels::check_span_cpu(b.ptr, b.count, b.dtype);
      done_[which[i]] = 1;
    }
  });
}

void GradCheck::run_range(int64_t lo, int64_t hi) {
  check_pointers();
  std::vector<int64_t> which;
  for (size_t b = 0; b < blocks_.size(); ++b)
    if (!done_[b] && block_start_[b] >= lo && block_start_[b] + blocks_[b].count <= hi)
      which.push_back(static_cast<int64_t>(b));
#ifdef LOCKSTEP_WITH_CUDA
  if (cuda_) {  // one launch per run of adjacent chunks, on the stream the bucket landed on
    for (const auto& [first, last] : runs_of(which)) cuda_->run_early(first, last);
    for (int64_t b : which) done_[b] = 1;
    return;
  }
#endif
  check_blocks(which);
}

void GradCheck::sum_baseline() {
  check_pointers();
  if (!sum_out_.defined()) sum_out_ = at::empty({1}, out_.options());
#ifdef LOCKSTEP_WITH_CUDA
  if (cuda_) {
    cuda_->sum(sum_out_.data_ptr<double>());
    return;
  }
#endif
  const auto partial = map_blocks<double>(blocks_, [](const kernels::Segment& b) {
    return kernels::sum_span_cpu(b.ptr, b.count, b.dtype);
  });
  double total = 0;
  for (double p : partial) total += p;
  sum_out_.data_ptr<double>()[0] = total;
}

GradCheckStats GradCheck::read(const at::Tensor& stats) {
  at::Tensor c = stats.to(at::kCPU);
  const double* p = c.const_data_ptr<double>();
  const int64_t n = (c.numel() - kernels::kStatsHeader) / 2;
  GradCheckStats s{p[0], p[1], p[2], {}, {}};
  for (int64_t t = 0; t < n; ++t) {
    s.tensor_nonfinite.push_back(p[kernels::kStatsHeader + 2 * t]);
    s.tensor_sumsq.push_back(p[kernels::kStatsHeader + 2 * t + 1]);
  }
  return s;
}

std::vector<std::pair<std::string, int64_t>> nonfinite_tensors(
    const std::vector<NamedTensor>& tensors) {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const NamedTensor& t : tensors) {
    if (!t.tensor.defined() || t.tensor.numel() == 0) continue;
    const int64_t n = at::isfinite(t.tensor.detach()).logical_not().sum().item<int64_t>();
    if (n > 0) out.emplace_back(t.name, n);
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  return out;
}

}  // namespace lockstep
