// CPU side of the fused gradient check: one pass, SIMD through GCC vector extensions, compiled
// three times — 16 lanes for x86-64-v4 (AVX-512), 8 lanes for x86-64-v3 (AVX2) and for the
// baseline (SSE2) — with the best chosen once at run time.
#include <cmath>
#include <cstring>

#include "kernels/gradcheck.h"

namespace lockstep::kernels {
namespace {

// W fp32 lanes; the raw 16-bit elements of W lanes; 4 fp64 lanes.
template <int W>
struct Vec {
  typedef float f __attribute__((vector_size(4 * W)));
  typedef int32_t i __attribute__((vector_size(4 * W)));
  typedef uint16_t h __attribute__((vector_size(2 * W)));
};
typedef double vd4 __attribute__((vector_size(32)));
typedef int64_t vl4 __attribute__((vector_size(32)));

#define LS_INLINE static inline __attribute__((always_inline))

constexpr int32_t kF32ExpMask = 0x7f800000;
constexpr int32_t kF16ExpMask = 0x7c00;
constexpr int64_t kF64ExpMask = 0x7ff0000000000000LL;

// W elements at p (any alignment) as fp32 values with the nonfinite lanes zeroed, and the
// nonfinite mask (-1 where nonfinite). bf16 and fp16 convert exactly to fp32.
template <DType D, int W>
LS_INLINE void loadw(const unsigned char* p, typename Vec<W>::f& x, typename Vec<W>::i& nonfinite) {
  using vf = typename Vec<W>::f;
  using vi = typename Vec<W>::i;
  using vh = typename Vec<W>::h;
  if constexpr (D == DType::kF32) {
    vi b;
    std::memcpy(&b, p, sizeof b);
    nonfinite = (b & kF32ExpMask) == kF32ExpMask;
    x = (vf)(b & ~nonfinite);
  } else if constexpr (D == DType::kBF16) {
    vh h;
    std::memcpy(&h, p, sizeof h);
    vi b = __builtin_convertvector(h, vi) << 16;  // bf16 is the top half of an fp32
    nonfinite = (b & kF32ExpMask) == kF32ExpMask;
    x = (vf)(b & ~nonfinite);
  } else {  // fp16: exponent rebias by a multiply, exact for normals and subnormals
    vh h;
    std::memcpy(&h, p, sizeof h);
    vi w = __builtin_convertvector(h, vi);
    nonfinite = (w & kF16ExpMask) == kF16ExpMask;
    vi magnitude = ((w & 0x7fff) << 13) & ~nonfinite;
    x = (vf)magnitude * 0x1p112f;  // the sign is irrelevant for squares
  }
}

// 2W bf16 elements at p as the fp32 bit patterns of two W-lane vectors, without a widening
// shuffle: read as W 32-bit words, each word's low half shifted up and its high half masked are
// exact fp32 values. Lane order differs from element order, which no sum minds.
template <int W>
LS_INLINE void bf16_pair(const unsigned char* p, typename Vec<W>::i& lo, typename Vec<W>::i& hi) {
  typename Vec<W>::i b;
  std::memcpy(&b, p, sizeof b);
  lo = b << 16;
  hi = b & static_cast<int32_t>(0xffff0000u);
}

// 4W bf16 elements at p as four W-lane fp32 vectors (the unrolled reads of the fast path and
// of the sum baseline).
template <int W>
LS_INLINE void bf16_quad(const unsigned char* p, typename Vec<W>::f& x0, typename Vec<W>::f& x1,
                         typename Vec<W>::f& x2, typename Vec<W>::f& x3) {
  using vf = typename Vec<W>::f;
  typename Vec<W>::i b0, b1, b2, b3;
  bf16_pair<W>(p, b0, b1);
  bf16_pair<W>(p + 4 * W, b2, b3);  // 2W bf16 further on
  x0 = (vf)b0, x1 = (vf)b1, x2 = (vf)b2, x3 = (vf)b3;
}

// One element as a double, or nullopt-like: returns false when nonfinite.
template <DType D>
LS_INLINE bool load1(const unsigned char* p, double& v) {
  if constexpr (D == DType::kF32) {
    float f;
    std::memcpy(&f, p, 4);
    v = f;
  } else if constexpr (D == DType::kBF16) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    uint32_t b = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    v = f;
  } else if constexpr (D == DType::kF16) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    if ((h & kF16ExpMask) == kF16ExpMask) return false;
    uint32_t m = static_cast<uint32_t>(h & 0x7fff) << 13;
    float f;
    std::memcpy(&f, &m, 4);
    v = static_cast<double>(f) * 0x1p112;
    return true;
  } else {
    std::memcpy(&v, p, 8);
  }
  return std::isfinite(v);
}

template <int W>
LS_INLINE double hsum(const typename Vec<W>::f& a) {  // by reference: no vector-ABI note
  double s = 0;
  for (int i = 0; i < W; ++i) s += a[i];
  return s;
}

// The fp64 redo of a run whose fp32 partial overflowed.
template <DType D>
double sumsq_f64(const unsigned char* p, int64_t n) {
  constexpr int kSize = D == DType::kF32 ? 4 : 2;
  double s = 0;
  for (int64_t i = 0; i < n; ++i) {
    double v = 0;
    if (load1<D>(p + i * kSize, v)) s += v * v;
  }
  return s;
}

// Fast path, one run: the fp32 sum of squares of every element, nonfinite ones included. A nan
// or inf element makes its lane's sum nonfinite (squares are >= 0, so inf never meets -inf),
// and so does a finite square past fp32's range: a finite result therefore proves the run holds
// no nonfinite element and no overflow. Returns +inf when the run needs the exact path.
template <DType D, int W>
LS_INLINE double fast_run(const unsigned char* q, int64_t n) {
  using vf = typename Vec<W>::f;
  using vi = typename Vec<W>::i;
  using vh = typename Vec<W>::h;
  constexpr int kSize = D == DType::kF32 ? 4 : 2;
  auto load = [&](const unsigned char* p, vf& x, vi& special) {
    if constexpr (D == DType::kF32) {
      std::memcpy(&x, p, sizeof x);
    } else if constexpr (D == DType::kBF16) {
      vh h;
      std::memcpy(&h, p, sizeof h);
      x = (vf)(__builtin_convertvector(h, vi) << 16);
    } else {  // fp16: the rebias multiply maps inf/nan to 65536, so flag them by exponent
      vh h;
      std::memcpy(&h, p, sizeof h);
      vi w = __builtin_convertvector(h, vi) & 0x7fff;
      special |= (w & kF16ExpMask) + 0x0400;  // bit 15 set iff the exponent is all ones
      x = (vf)(w << 13) * 0x1p112f;
    }
  };
  vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
  vi special = {};
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {  // 4 independent accumulators hide the add latency
    vf x0, x1, x2, x3;
    if constexpr (D == DType::kBF16) {
      bf16_quad<W>(q + i * kSize, x0, x1, x2, x3);
    } else {
      load(q + (i + 0 * W) * kSize, x0, special);
      load(q + (i + 1 * W) * kSize, x1, special);
      load(q + (i + 2 * W) * kSize, x2, special);
      load(q + (i + 3 * W) * kSize, x3, special);
    }
    a0 += x0 * x0;
    a1 += x1 * x1;
    a2 += x2 * x2;
    a3 += x3 * x3;
  }
  for (; i + W <= n; i += W) {
    vf x;
    load(q + i * kSize, x, special);
    a0 += x * x;
  }
  float tail = 0;
  for (; i < n; ++i) {
    double v;
    if (!load1<D>(q + i * kSize, v)) return INFINITY;
    tail += static_cast<float>(v * v);
  }
  if constexpr (D == DType::kF16) {
    int32_t any = 0;
    for (int l = 0; l < W; ++l) any |= special[l];
    if (any & 0x8000) return INFINITY;
  }
  return hsum<W>((a0 + a1) + (a2 + a3)) + tail;
}

// Exact path, one run: counts nonfinite elements and sums the squares of the finite ones; a run
// whose fp32 partial overflows is summed again in fp64 and counted in overflow_runs.
template <DType D, int W>
LS_INLINE SpanStats exact_run(const unsigned char* q, int64_t n) {
  using vf = typename Vec<W>::f;
  using vi = typename Vec<W>::i;
  constexpr int kSize = D == DType::kF32 ? 4 : 2;
  vf a0 = {}, a1 = {};
  vi c = {};
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    vf x0, x1;
    vi n0, n1;
    if constexpr (D == DType::kBF16) {
      vi b0, b1;
      bf16_pair<W>(q + i * kSize, b0, b1);
      n0 = (b0 & kF32ExpMask) == kF32ExpMask;
      n1 = (b1 & kF32ExpMask) == kF32ExpMask;
      x0 = (vf)(b0 & ~n0);
      x1 = (vf)(b1 & ~n1);
    } else {
      loadw<D, W>(q + i * kSize, x0, n0);
      loadw<D, W>(q + (i + W) * kSize, x1, n1);
    }
    a0 += x0 * x0;
    a1 += x1 * x1;
    c += n0 + n1;  // each lane adds -1 per nonfinite element
  }
  float tail = 0;
  int64_t nonfinite = 0;
  for (; i < n; ++i) {
    double v;
    if (load1<D>(q + i * kSize, v))
      tail += static_cast<float>(v * v);
    else
      ++nonfinite;
  }
  for (int l = 0; l < W; ++l) nonfinite -= c[l];
  // Nonfinite elements were zeroed: an infinite lane now means the squares overflowed fp32.
  double run = hsum<W>(a0 + a1) + tail;
  const bool overflow = !std::isfinite(run);
  if (overflow) run = sumsq_f64<D>(q, n);
  return {nonfinite, run, overflow ? 1 : 0};
}

template <DType D, int W>
LS_INLINE SpanStats check_narrow(const unsigned char* p, int64_t count) {
  constexpr int kSize = D == DType::kF32 ? 4 : 2;
  SpanStats out;
  for (int64_t start = 0; start < count; start += kRunElems) {
    const int64_t n = count - start < kRunElems ? count - start : kRunElems;
    const unsigned char* q = p + start * kSize;
    const double fast = fast_run<D, W>(q, n);
    if (std::isfinite(fast)) {
      out.sumsq += fast;
      continue;
    }
    const SpanStats exact = exact_run<D, W>(q, n);  // rare: a bad or huge gradient
    out.nonfinite += exact.nonfinite;
    out.sumsq += exact.sumsq;
    out.overflow_runs += exact.overflow_runs;
  }
  return out;
}

LS_INLINE SpanStats check_f64(const unsigned char* p, int64_t count) {
  SpanStats out;
  for (int64_t start = 0; start < count; start += kRunElems) {
    const int64_t n = count - start < kRunElems ? count - start : kRunElems;
    const unsigned char* q = p + start * 8;
    vd4 a0 = {}, a1 = {};
    vl4 c = {};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      vl4 b0, b1;
      std::memcpy(&b0, q + i * 8, 32);
      std::memcpy(&b1, q + (i + 4) * 8, 32);
      vl4 n0 = (b0 & kF64ExpMask) == kF64ExpMask, n1 = (b1 & kF64ExpMask) == kF64ExpMask;
      vd4 x0 = (vd4)(b0 & ~n0), x1 = (vd4)(b1 & ~n1);
      a0 += x0 * x0;
      a1 += x1 * x1;
      c += n0 + n1;
    }
    double run = 0;
    vd4 a = a0 + a1;
    for (int l = 0; l < 4; ++l) {
      run += a[l];
      out.nonfinite -= c[l];
    }
    for (; i < n; ++i) {
      double v;
      if (load1<DType::kF64>(q + i * 8, v))
        run += v * v;
      else
        ++out.nonfinite;
    }
    if (!std::isfinite(run)) ++out.overflow_runs;  // beyond fp64: reported, not recovered
    out.sumsq += run;
  }
  return out;
}

template <DType D, int W>
LS_INLINE double sum_narrow(const unsigned char* p, int64_t count) {
  using vf = typename Vec<W>::f;
  using vi = typename Vec<W>::i;
  constexpr int kSize = D == DType::kF32 ? 4 : 2;
  double total = 0;
  for (int64_t start = 0; start < count; start += kRunElems) {
    const int64_t n = count - start < kRunElems ? count - start : kRunElems;
    const unsigned char* q = p + start * kSize;
    vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
    int64_t i = 0;
    for (; i + 4 * W <= n; i += 4 * W) {
      vf x0, x1, x2, x3;
      if constexpr (D == DType::kF32) {
        std::memcpy(&x0, q + (i + 0 * W) * 4, sizeof x0);
        std::memcpy(&x1, q + (i + 1 * W) * 4, sizeof x1);
        std::memcpy(&x2, q + (i + 2 * W) * 4, sizeof x2);
        std::memcpy(&x3, q + (i + 3 * W) * 4, sizeof x3);
      } else if constexpr (D == DType::kBF16) {  // the same reads as the check's
        bf16_quad<W>(q + i * 2, x0, x1, x2, x3);
      } else {
        vi m;  // the conversion is part of reading fp16, the checks are not
        loadw<D, W>(q + (i + 0 * W) * kSize, x0, m);
        loadw<D, W>(q + (i + 1 * W) * kSize, x1, m);
        loadw<D, W>(q + (i + 2 * W) * kSize, x2, m);
        loadw<D, W>(q + (i + 3 * W) * kSize, x3, m);
      }
      a0 += x0;
      a1 += x1;
      a2 += x2;
      a3 += x3;
    }
    double run = hsum<W>((a0 + a1) + (a2 + a3));
    for (; i < n; ++i) {
      double v = 0;
      load1<D>(q + i * kSize, v);
      run += v;
    }
    total += run;
  }
  return total;
}

LS_INLINE double sum_f64(const unsigned char* p, int64_t count) {
  vd4 a0 = {}, a1 = {};
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    vd4 x0, x1;
    std::memcpy(&x0, p + i * 8, 32);
    std::memcpy(&x1, p + (i + 4) * 8, 32);
    a0 += x0;
    a1 += x1;
  }
  double s = 0;
  vd4 a = a0 + a1;
  for (int l = 0; l < 4; ++l) s += a[l];
  for (; i < count; ++i) {
    double v;
    std::memcpy(&v, p + i * 8, 8);
    s += v;
  }
  return s;
}

template <int W>
LS_INLINE SpanStats check_any(const void* ptr, int64_t count, DType dtype) {
  auto p = static_cast<const unsigned char*>(ptr);
  switch (dtype) {
    case DType::kF32: return check_narrow<DType::kF32, W>(p, count);
    case DType::kBF16: return check_narrow<DType::kBF16, W>(p, count);
    case DType::kF16: return check_narrow<DType::kF16, W>(p, count);
    case DType::kF64: return check_f64(p, count);
  }
  return {};
}

template <int W>
LS_INLINE double sum_any(const void* ptr, int64_t count, DType dtype) {
  auto p = static_cast<const unsigned char*>(ptr);
  switch (dtype) {
    case DType::kF32: return sum_narrow<DType::kF32, W>(p, count);
    case DType::kBF16: return sum_narrow<DType::kBF16, W>(p, count);
    case DType::kF16: return sum_narrow<DType::kF16, W>(p, count);
    case DType::kF64: return sum_f64(p, count);
  }
  return 0;
}

// The same source three times; the templates above are inlined into each with its ISA.
__attribute__((target("arch=x86-64-v4"))) SpanStats check_v4(const void* p, int64_t n, DType d) {
  return check_any<16>(p, n, d);
}
__attribute__((target("arch=x86-64-v3"))) SpanStats check_v3(const void* p, int64_t n, DType d) {
  return check_any<8>(p, n, d);
}
SpanStats check_v1(const void* p, int64_t n, DType d) { return check_any<8>(p, n, d); }
__attribute__((target("arch=x86-64-v4"))) double sum_v4(const void* p, int64_t n, DType d) {
  return sum_any<16>(p, n, d);
}
__attribute__((target("arch=x86-64-v3"))) double sum_v3(const void* p, int64_t n, DType d) {
  return sum_any<8>(p, n, d);
}
double sum_v1(const void* p, int64_t n, DType d) { return sum_any<8>(p, n, d); }

int isa_level() {
  static const int level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return 4;
    if (__builtin_cpu_supports("x86-64-v3")) return 3;
    return 1;
  }();
  return level;
}

}  // namespace

SpanStats check_span_cpu(const void* ptr, int64_t count, DType dtype) {
  switch (isa_level()) {
    case 4: return check_v4(ptr, count, dtype);
    case 3: return check_v3(ptr, count, dtype);
    default: return check_v1(ptr, count, dtype);
  }
}

double sum_span_cpu(const void* ptr, int64_t count, DType dtype) {
  switch (isa_level()) {
    case 4: return sum_v4(ptr, count, dtype);
    case 3: return sum_v3(ptr, count, dtype);
    default: return sum_v1(ptr, count, dtype);
  }
}

const char* cpu_isa() {
  switch (isa_level()) {
    case 4: return "x86-64-v4 (AVX-512, 16 lanes)";
    case 3: return "x86-64-v3 (AVX2, 8 lanes)";
    default: return "x86-64 (SSE2, 8 lanes)";
  }
}

}  // namespace lockstep::kernels
