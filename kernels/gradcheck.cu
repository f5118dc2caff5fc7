// CUDA side of the fused gradient check: one launch over the whole tensor table (or several:
// chunks checked early as their bucket lands, then one that checks the rest and reduces).
//
// Shape: a persistent grid walks fixed-size chunks of the segment table. Inside a chunk each
// thread reads 16-byte vectors (scalar head and tail peeled off so the vectors are aligned),
// squares into an fp32 register (a bounded run: one thread's share of one chunk) and counts
// nonfinite elements; warps reduce counts with __reduce_add_sync and sums with shuffles; each
// block writes one result per chunk. The last block to finish (a wrap-around ticket: atomicInc
// returns the counter to 0 as the last block takes its ticket, so no launch ever leaves it
// non-zero) reduces the chunk results in a fixed order into per-tensor and total stats (a
// tensor of a few chunks by one thread, a larger one by a warp), so the same input always gives
// the same bits and the launch can be replayed in a CUDA graph.
// Launches of one plan share its chunk buffers: cuda_check orders them with an event, so a
// launch from another stream waits for the previous one instead of racing it. Chunks may be
// checked early, by launches that only write their results (cuda_check_chunks: a bucket of the
// gradient sync that has landed); the reducing launch checks the rest and reads them all, in
// the same fixed order, so the bits do not depend on which launch checked a chunk.
//
// A chunk is one overflow run (kernels/gradcheck.h): kRunElems elements of a segment, cut from
// its start as the CPU cuts its runs, counted once when any of its partials overflowed.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <vector>

#include "kernels/gradcheck.h"

namespace lockstep::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kChunkElems = kRunElems;  // a chunk is one run: the same overflow_runs

struct Chunk {
  const void* ptr;
  int32_t count;  // <= kChunkElems
  int32_t tensor;
  int32_t dtype;
};

// A tensor of at most this many chunks is reduced by one thread, larger ones by a warp.
constexpr int kThreadChunks = 8;

struct PlanView {  // what the kernel reads; passed by value
  const Chunk* chunks;
  const int32_t* tensor_first;  // [num_tensors + 1]: chunks of tensor t are [first[t], first[t+1])
  const int32_t* large;         // the tensors of more than kThreadChunks chunks, ascending
  double* chunk_sumsq;
  unsigned long long* chunk_nonfinite;
  unsigned int* chunk_overflow;
  unsigned int* ticket;
  int num_chunks;
  int num_tensors;
  int num_large;
  int first, last;  // the chunks this launch checks: [first, last)
};

template <int D>
struct Elem;
// unpack: one raw element (bits) -> fp32 value and whether it is finite.
template <>
struct Elem<0> {  // fp32
  using Raw = float;
  __device__ static bool unpack(uint32_t b, float& x) {
    x = __uint_as_float(b);
    return (b & 0x7f800000u) != 0x7f800000u;
  }
};
template <>
struct Elem<1> {  // bf16: the top half of an fp32
  using Raw = unsigned short;
  __device__ static bool unpack(unsigned short h, float& x) {
    const uint32_t b = static_cast<uint32_t>(h) << 16;
    x = __uint_as_float(b);
    return (b & 0x7f800000u) != 0x7f800000u;
  }
};
template <>
struct Elem<2> {  // fp16
  using Raw = unsigned short;
  __device__ static bool unpack(unsigned short h, float& x) {
    x = __half2float(__ushort_as_half(h));
    return (h & 0x7c00u) != 0x7c00u;
  }
};

template <int D>
__device__ __forceinline__ bool load_one(const typename Elem<D>::Raw* p, int64_t i, float& x) {
  if constexpr (D == 0)
    return Elem<0>::unpack(__float_as_uint(p[i]), x);
  else
    return Elem<D>::unpack(p[i], x);
}

// Calls f(value, finite) for every element this thread owns in the chunk: scalar head up to
// 16-byte alignment, 16-byte vectors, scalar tail.
template <int D, typename F>
__device__ __forceinline__ void walk(const Chunk& c, F&& f) {
  using Raw = typename Elem<D>::Raw;
  constexpr int kPer = 16 / sizeof(Raw);
  const Raw* p = static_cast<const Raw*>(c.ptr);
  const int64_t n = c.count;
  int64_t head = ((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15) / sizeof(Raw);
  if (reinterpret_cast<uintptr_t>(p) % sizeof(Raw) != 0) head = n;  // never for real tensors
  if (head > n) head = n;
  for (int64_t i = threadIdx.x; i < head; i += kThreads) {
    float x;
    bool ok = load_one<D>(p, i, x);
    f(x, ok);
  }
  const int64_t nvec = (n - head) / kPer;
  const uint4* v = reinterpret_cast<const uint4*>(p + head);
  for (int64_t j = threadIdx.x; j < nvec; j += kThreads) {
    const uint4 w = __ldg(v + j);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};  // registers after unrolling
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (sizeof(Raw) == 4) {
        float x;
        bool ok = Elem<D>::unpack(words[k], x);
        f(x, ok);
      } else {  // two 16-bit elements per word, low half first (little-endian)
        float x0, x1;
        bool ok0 = Elem<D>::unpack(static_cast<unsigned short>(words[k] & 0xffffu), x0);
        bool ok1 = Elem<D>::unpack(static_cast<unsigned short>(words[k] >> 16), x1);
        f(x0, ok0);
        f(x1, ok1);
      }
    }
  }
  for (int64_t i = head + nvec * kPer + threadIdx.x; i < n; i += kThreads) {
    float x;
    bool ok = load_one<D>(p, i, x);
    f(x, ok);
  }
}

// fp64 elements: plain strided loop (fp64 gradients are rare; correctness over speed).
template <typename F>
__device__ __forceinline__ void walk_f64(const Chunk& c, F&& f) {
  const double* p = static_cast<const double*>(c.ptr);
  for (int64_t i = threadIdx.x; i < c.count; i += kThreads) {
    double x = p[i];
    f(x, (__double_as_longlong(x) & 0x7ff0000000000000LL) != 0x7ff0000000000000LL);
  }
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

// Fixed-shape block reduction of a double (lane 0 of each warp, then warp 0): deterministic.
__device__ double block_sum(double v, double* smem) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // smem may still be read from the previous call
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = threadIdx.x < kWarps ? smem[threadIdx.x] : 0.0;
  if (warp == 0) v = warp_sum(v);
  return v;  // valid in thread 0
}

__device__ unsigned long long block_count(unsigned int c, unsigned long long* smem) {
#if __CUDA_ARCH__ >= 800
  unsigned int w = __reduce_add_sync(0xffffffffu, c);  // warp-aggregated count
#else
  unsigned int w = c;
  for (int o = 16; o > 0; o >>= 1) w += __shfl_down_sync(0xffffffffu, w, o);
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) smem[warp] = w;
  __syncthreads();
  unsigned long long total = 0;
  if (threadIdx.x == 0)
    for (int i = 0; i < kWarps; ++i) total += smem[i];
  return total;  // valid in thread 0
}

template <int D>
__device__ void check_chunk(const Chunk& c, double& sumsq, unsigned int& nonfinite,
                            unsigned int& overflow) {
  float acc = 0.f;
  unsigned int nf = 0;
  walk<D>(c, [&](float x, bool ok) {
    if (ok)
      acc = fmaf(x, x, acc);
    else
      ++nf;
  });
  if (!isfinite(acc)) {  // only squares of finite values went in: fp32 overflow, redo in fp64
    double d = 0;
    walk<D>(c, [&](float x, bool ok) {
      if (ok) d += static_cast<double>(x) * x;
    });
    sumsq = d;
    overflow = 1;
  } else {
    sumsq = acc;
  }
  nonfinite = nf;
}

// Per tensor, its chunks' results in a fixed order into out: a small tensor (most of them in a
// model of many tensors) by one thread, its chunks in order; a large one by a warp, lane l
// summing chunks l, l+32, ... in order, then the fixed shuffle tree.
__device__ void reduce_tensors(const PlanView& p, double* out) {
  for (int t = threadIdx.x; t < p.num_tensors; t += kThreads) {
    const int lo = p.tensor_first[t], hi = p.tensor_first[t + 1];
    if (hi - lo > kThreadChunks) continue;
    double s = 0, n = 0;
    for (int ci = lo; ci < hi; ++ci) {
      s += __ldcg(p.chunk_sumsq + ci);
      n += static_cast<double>(__ldcg(p.chunk_nonfinite + ci));
    }
    out[kStatsHeader + 2 * t] = n;
    out[kStatsHeader + 2 * t + 1] = s;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int k = warp; k < p.num_large; k += kWarps) {
    const int t = p.large[k];
    double s = 0, n = 0;
    for (int ci = p.tensor_first[t] + lane; ci < p.tensor_first[t + 1]; ci += 32) {
      s += __ldcg(p.chunk_sumsq + ci);
      n += static_cast<double>(__ldcg(p.chunk_nonfinite + ci));
    }
    s = warp_sum(s);
    n = warp_sum(n);
    if (lane == 0) {
      out[kStatsHeader + 2 * t] = n;
      out[kStatsHeader + 2 * t + 1] = s;
    }
  }
}

// Checks chunks [p.first, p.last) into the plan's chunk results; with `out`, the last block to
// finish then reduces every chunk's result (those of earlier launches included).
__global__ void __launch_bounds__(kThreads) gradcheck_kernel(PlanView p, double* out) {
  __shared__ double dsm[kWarps];
  __shared__ unsigned long long usm[kWarps];
  __shared__ bool is_last;

  for (int ci = p.first + static_cast<int>(blockIdx.x); ci < p.last; ci += gridDim.x) {
    const Chunk c = p.chunks[ci];
    double sumsq = 0;
    unsigned int nf = 0, ovf = 0;
    switch (c.dtype) {
      case 0: check_chunk<0>(c, sumsq, nf, ovf); break;
      case 1: check_chunk<1>(c, sumsq, nf, ovf); break;
      case 2: check_chunk<2>(c, sumsq, nf, ovf); break;
      default:
        walk_f64(c, [&](double x, bool ok) {
          if (ok)
            sumsq += x * x;
          else
            ++nf;
        });
        ovf = isfinite(sumsq) ? 0 : 1;  // beyond fp64: reported, not recovered (as on the CPU)
    }
    const double s = block_sum(sumsq, dsm);
    const unsigned long long n = block_count(nf, usm);
    const unsigned long long o = block_count(ovf, usm);
    if (threadIdx.x == 0) {
      p.chunk_sumsq[ci] = s;
      p.chunk_nonfinite[ci] = n;
      // fp64: the chunk's sum may overflow although no thread's did.
      p.chunk_overflow[ci] = o > 0 || (c.dtype == 3 && !isfinite(s)) ? 1u : 0u;
    }
  }

  if (out == nullptr) return;  // an early launch: a later one reduces
  // The last block to arrive reduces every chunk result in a fixed order.
  __threadfence();
  __syncthreads();
  // atomicInc(t, n) stores (old >= n ? 0 : old + 1): the last of gridDim.x blocks resets it.
  if (threadIdx.x == 0) is_last = atomicInc(p.ticket, gridDim.x - 1) == gridDim.x - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();

  reduce_tensors(p, out);
  __syncthreads();
  // Totals: each thread a fixed strided subset in order, then the fixed-shape block sum.
  double ts = 0, tn = 0, to = 0;
  for (int t = threadIdx.x; t < p.num_tensors; t += kThreads) {
    tn += out[kStatsHeader + 2 * t];
    ts += out[kStatsHeader + 2 * t + 1];
  }
  for (int ci = threadIdx.x; ci < p.num_chunks; ci += kThreads) to += __ldcg(p.chunk_overflow + ci);
  tn = block_sum(tn, dsm);
  ts = block_sum(ts, dsm);
  to = block_sum(to, dsm);
  if (threadIdx.x == 0) {
    out[0] = tn;
    out[1] = ts;
    out[2] = to;
  }
}

__global__ void __launch_bounds__(kThreads) sum_kernel(PlanView p, double* out) {
  __shared__ double dsm[kWarps];
  double mine = 0;
  for (int ci = blockIdx.x; ci < p.num_chunks; ci += gridDim.x) {
    const Chunk c = p.chunks[ci];
    float acc = 0.f;
    auto add = [&](float x, bool) { acc += x; };
    switch (c.dtype) {
      case 0: walk<0>(c, add); break;
      case 1: walk<1>(c, add); break;
      case 2: walk<2>(c, add); break;
      default: walk_f64(c, [&](double x, bool) { mine += x; });
    }
    mine += acc;
  }
  const double s = block_sum(mine, dsm);
  if (threadIdx.x == 0) atomicAdd(out, s);
}

}  // namespace

struct CudaPlan {
  PlanView view{};
  void* chunk_mem = nullptr;  // one allocation for every device array
  int grid = 1;
  int device = 0;                // where the plan's memory lives
  cudaEvent_t done = nullptr;    // recorded after each launch; the next one waits for it
};

int cuda_plan_create(const Segment* segments, int num_segments, int num_tensors,
                     CudaPlan** out) {
  std::vector<Chunk> chunks;
  std::vector<int32_t> first(static_cast<size_t>(num_tensors) + 1, 0);
  int cur_tensor = 0;
  for (int s = 0; s < num_segments; ++s) {
    const Segment& g = segments[s];
    while (cur_tensor <= g.tensor) first[cur_tensor++] = static_cast<int32_t>(chunks.size());
    const int size = dtype_size(g.dtype);
    for (int64_t start = 0; start < g.count; start += kChunkElems) {
      const int64_t n = g.count - start < kChunkElems ? g.count - start : kChunkElems;
      chunks.push_back({static_cast<const char*>(g.ptr) + start * size, static_cast<int32_t>(n),
                        g.tensor, static_cast<int32_t>(g.dtype)});
    }
  }
  while (cur_tensor <= num_tensors) first[cur_tensor++] = static_cast<int32_t>(chunks.size());
  std::vector<int32_t> large;
  for (int t = 0; t < num_tensors; ++t)
    if (first[t + 1] - first[t] > kThreadChunks) large.push_back(t);

  const size_t nc = chunks.empty() ? 1 : chunks.size();
  auto align = [](size_t x) { return (x + 255) & ~size_t{255}; };
  const size_t off_first = align(nc * sizeof(Chunk));
  const size_t off_large = off_first + align(first.size() * sizeof(int32_t));
  const size_t off_sumsq = off_large + align((large.empty() ? 1 : large.size()) * sizeof(int32_t));
  const size_t off_nf = off_sumsq + align(nc * sizeof(double));
  const size_t off_ovf = off_nf + align(nc * sizeof(unsigned long long));
  const size_t off_ticket = off_ovf + align(nc * sizeof(unsigned int));
  const size_t bytes = off_ticket + 256;

  auto* plan = new CudaPlan;
  cudaError_t e = cudaMalloc(&plan->chunk_mem, bytes);
  if (e != cudaSuccess) {
    delete plan;
    return e;
  }
  char* base = static_cast<char*>(plan->chunk_mem);
  if (!chunks.empty()) e = cudaMemcpy(base, chunks.data(), chunks.size() * sizeof(Chunk),
                                      cudaMemcpyHostToDevice);
  if (e == cudaSuccess)
    e = cudaMemcpy(base + off_first, first.data(), first.size() * sizeof(int32_t),
                   cudaMemcpyHostToDevice);
  if (e == cudaSuccess && !large.empty())
    e = cudaMemcpy(base + off_large, large.data(), large.size() * sizeof(int32_t),
                   cudaMemcpyHostToDevice);
  if (e == cudaSuccess) e = cudaMemset(base + off_ticket, 0, sizeof(unsigned int));
  int device = 0, sms = 1, per_sm = 1;
  if (e == cudaSuccess) e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gradcheck_kernel, kThreads, 0);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&plan->done, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    cudaFree(plan->chunk_mem);
    delete plan;
    return e;
  }
  plan->device = device;
  plan->view = {reinterpret_cast<const Chunk*>(base),
                reinterpret_cast<const int32_t*>(base + off_first),
                reinterpret_cast<const int32_t*>(base + off_large),
                reinterpret_cast<double*>(base + off_sumsq),
                reinterpret_cast<unsigned long long*>(base + off_nf),
                reinterpret_cast<unsigned int*>(base + off_ovf),
                reinterpret_cast<unsigned int*>(base + off_ticket),
                static_cast<int>(chunks.size()),
                num_tensors,
                static_cast<int>(large.size()),
                0,
                static_cast<int>(chunks.size())};
  const int persistent = sms * (per_sm > 0 ? per_sm : 1);
  plan->grid = static_cast<int>(chunks.size()) < persistent ? static_cast<int>(chunks.size())
                                                            : persistent;
  if (plan->grid < 1) plan->grid = 1;
  *out = plan;
  return cudaSuccess;
}

void cuda_plan_destroy(CudaPlan* plan) {
  if (!plan) return;
  if (plan->done) cudaEventDestroy(plan->done);
  cudaFree(plan->chunk_mem);
  delete plan;
}

int cuda_plan_device(const CudaPlan* plan) { return plan->device; }

int cuda_plan_chunks(const CudaPlan* plan) { return plan->view.num_chunks; }

namespace {

// One launch of the check over chunks [first, last), reducing into `out` when it is set.
cudaError_t launch_check(const CudaPlan* plan, int first, int last, double* out, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  // Eager launches are ordered after the plan's previous launch, whatever its stream; inside a
  // graph capture the graph orders its own nodes (and an event recorded outside it may not be
  // waited on there).
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(s, &capturing);
  const bool eager = e == cudaSuccess && capturing == cudaStreamCaptureStatusNone;
  if (e == cudaSuccess && eager) e = cudaStreamWaitEvent(s, plan->done, 0);
  if (e != cudaSuccess) return e;
  PlanView view = plan->view;
  view.first = first < 0 ? 0 : first;
  view.last = last < view.first ? view.first : last > view.num_chunks ? view.num_chunks : last;
  const int chunks = view.last - view.first;
  const int grid = chunks < plan->grid ? (chunks > 0 ? chunks : 1) : plan->grid;
  gradcheck_kernel<<<grid, kThreads, 0, s>>>(view, out);
  e = cudaGetLastError();
  if (e == cudaSuccess && eager) e = cudaEventRecord(plan->done, s);
  return e;
}

}  // namespace

int cuda_check(const CudaPlan* plan, double* out, void* stream, int first, int last) {
  return launch_check(plan, first, last < 0 ? plan->view.num_chunks : last, out, stream);
}

int cuda_check_chunks(const CudaPlan* plan, int first, int last, void* stream) {
  return first < last ? launch_check(plan, first, last, nullptr, stream) : cudaSuccess;
}

int cuda_sum(const CudaPlan* plan, double* out, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaMemsetAsync(out, 0, sizeof(double), s);
  if (e != cudaSuccess) return e;
  sum_kernel<<<plan->grid, kThreads, 0, s>>>(plan->view, out);
  return cudaGetLastError();
}

}  // namespace lockstep::kernels
