// Fused gradient health check: one read pass over gradient bytes that yields, per tensor, the
// exact count of nonfinite elements (nan, +inf, -inf) and the sum of squares of the finite
// elements. Framework-free: raw pointers in, plain structs out (CPU) or a device buffer (CUDA).
//
// Numerics: squares are accumulated in fp32 partials within bounded runs and in fp64 across
// runs. A *run* is kRunElems consecutive elements of a segment, cut from the segment's start, on
// the CPU and on CUDA alike. When a run's fp32 partials overflow although all its elements are
// finite (|x| > ~1.8e19), the run is summed again in fp64 and counted once in `overflow_runs`
// (fp64 data: a run whose fp64 sum overflows is counted, and its sum stays inf): "nonfinite
// values" and "a norm too large for fp32" are different facts and are reported apart.
#pragma once

#include <cstdint>

namespace lockstep::kernels {

enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kF64 = 3 };

inline int dtype_size(DType d) {
  switch (d) {
    case DType::kF32: return 4;
    case DType::kBF16:
    case DType::kF16: return 2;
    case DType::kF64: return 8;
  }
  return 0;
}

// A contiguous run of one tensor's elements that lies in the checked shard.
struct Segment {
  const void* ptr;  // first element of the run
  int64_t count;    // elements
  int32_t tensor;   // index of the tensor (its output slot)
  DType dtype;
};

// The stats of one span of elements.
struct SpanStats {
  int64_t nonfinite = 0;      // exact
  double sumsq = 0.0;         // of the finite elements
  int64_t overflow_runs = 0;  // runs whose fp32 partial overflowed and were redone in fp64
};

// Layout of the output buffer (fp64, one small buffer shaped for a single collective; the
// counts are exact integers, well below 2^53):
//   [0] total nonfinite count   [1] total sum of squares   [2] overflow runs
//   [3 + 2 i] tensor i nonfinite count   [4 + 2 i] tensor i sum of squares
constexpr int kStatsHeader = 3;
constexpr int stats_size(int num_tensors) { return kStatsHeader + 2 * num_tensors; }

// --- CPU ---------------------------------------------------------------------------------
constexpr int64_t kRunElems = 16384;  // fp32 accumulation run on the CPU (<= 256 terms a lane)

// One span, single-threaded, SIMD (the best of AVX-512 / AVX2 / SSE2 chosen at run time).
SpanStats check_span_cpu(const void* ptr, int64_t count, DType dtype);

// The speed-of-light baseline: a plain SIMD sum of the same bytes (no checks), same dispatch.
double sum_span_cpu(const void* ptr, int64_t count, DType dtype);

// Which instruction set check_span_cpu runs with on this machine ("avx512f", "avx2", "sse2").
const char* cpu_isa();

// --- CUDA --------------------------------------------------------------------------------
// A plan: the segment table cut into chunks, uploaded once and reused while the gradient
// pointers stay the same. All device memory is allocated when the plan is built, so a check
// allocates nothing, copies nothing from the host, and can be captured in a CUDA graph.
struct CudaPlan;

// Builds a plan on the current device. Returns cudaSuccess (0) or the CUDA error code.
int cuda_plan_create(const Segment* segments, int num_segments, int num_tensors,
                     CudaPlan** plan);
void cuda_plan_destroy(CudaPlan* plan);
int cuda_plan_device(const CudaPlan* plan);  // the device it was built on

// The plan's chunks: each segment cut from its start into runs of kRunElems elements, in
// segment order (chunk i of a plan is run i of its segment table).
int cuda_plan_chunks(const CudaPlan* plan);

// One launch: checks chunks [first, last) (last -1: to the end), then writes
// stats_size(num_tensors) doubles to `out` (device memory) on `stream` (a cudaStream_t of the
// plan's device) from every chunk's result: the rest must have been checked by
// cuda_check_chunks since the previous cuda_check. The result is bitwise deterministic for a
// given plan and input, whichever launch checked a chunk. Eager launches of one plan are
// ordered (an event), also across streams.
int cuda_check(const CudaPlan* plan, double* out, void* stream, int first = 0, int last = -1);

// Checks chunks [first, last) now (a bucket of the sync has landed); their results wait in the
// plan for the next cuda_check. No-op when first >= last.
int cuda_check_chunks(const CudaPlan* plan, int first, int last, void* stream);

// The speed-of-light baseline on the device: a plain vectorized sum over the same chunks,
// written to out[0]. Same launch shape as cuda_check.
int cuda_sum(const CudaPlan* plan, double* out, void* stream);

// Launches and device-to-host syncs issued by one cuda_check call (for the benchmark).
constexpr int kCudaCheckLaunches = 1;
constexpr int kCudaCheckHostSyncs = 0;

}  // namespace lockstep::kernels
