// Rolling windows and their statistics, in fp64 with one canonical NaN, compiled alike for the
// host and the device: the bits of every decision start here.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__CUDACC__)
#define LOCKSTEP_HD __host__ __device__
#else
#define LOCKSTEP_HD
#endif

namespace lockstep::core {

LOCKSTEP_HD inline double nan_value() {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(0x7ff8000000000000LL);  // the host's quiet NaN, bit for bit
#else
  return std::numeric_limits<double>::quiet_NaN();
#endif
}
LOCKSTEP_HD inline double inf_value() {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(0x7ff0000000000000LL);
#else
  return std::numeric_limits<double>::infinity();
#endif
}
// A GPU's arithmetic NaN may carry other bits than the CPU's.
LOCKSTEP_HD inline double canonical(double v) { return v != v ? nan_value() : v; }

LOCKSTEP_HD inline double max_of(double a, double b) { return a < b ? b : a; }
LOCKSTEP_HD inline double min_of(double a, double b) { return b < a ? b : a; }

// ---- statistics of `n` values read by at(i), i = 0 the oldest, summed oldest first -------------

template <class At>
LOCKSTEP_HD double window_mean(const At& at, int64_t n) {
  if (n == 0) return nan_value();
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += at(i);
  return s / static_cast<double>(n);
}

// Population standard deviation.
template <class At>
LOCKSTEP_HD double window_stddev(const At& at, int64_t n) {
  if (n == 0) return nan_value();
  const double m = window_mean(at, n);
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += (at(i) - m) * (at(i) - m);
  return std::sqrt(s / static_cast<double>(n));
}

// The std is floored at 1e-12 * |mean| so that a flat window is not a hair trigger.
template <class At>
LOCKSTEP_HD double window_zscore(const At& at, int64_t n, double v) {
  const double m = window_mean(at, n);
  const double sd = max_of(window_stddev(at, n), 1e-12 * std::fabs(m));
  if (sd == 0) return v > m ? inf_value() : 0.0;
  return (v - m) / sd;
}

// The largest value a window accepts, mean + z * std, once it holds min_history values; else v.
template <class At>
LOCKSTEP_HD double window_bounded(const At& at, int64_t n, double v, double z,
                                  int64_t min_history) {
  if (n < min_history || z <= 0 || !std::isfinite(v)) return v;
  return min_of(v, window_mean(at, n) + z * window_stddev(at, n));
}

// ---- rings: a window's storage --------------------------------------------------------------

// values[(head + i) % capacity], i = 0 the oldest.
struct Ring {
  double* values;
  int64_t capacity;
  int64_t head;
  int64_t size;
};

// One subtraction, no division: an anomalous step reads every rank's windows value by value.
LOCKSTEP_HD inline double ring_at(const Ring& r, int64_t i) {
  const int64_t j = r.head + i;
  return r.values[j < r.capacity ? j : j - r.capacity];
}

LOCKSTEP_HD inline void ring_push(Ring& r, double v) {
  if (r.size < r.capacity) {
    r.values[(r.head + r.size) % r.capacity] = v;
    ++r.size;
  } else {
    r.values[r.head] = v;
    r.head = (r.head + 1) % r.capacity;
  }
}

// Every rank's own two windows in one block: window i = 2r + k (k 0: gradient norms, 1: losses)
// keeps its head and size at meta[2i], meta[2i + 1] (integers, exact as doubles) and its values
// at values[i * capacity, (i + 1) * capacity), so the block moves to a device in one copy.
struct RankWindows {
  double* meta;
  double* values;
  int64_t capacity;
};

enum RankWindow : int { kRankGradNorms = 0, kRankLosses = 1 };

LOCKSTEP_HD inline Ring rank_ring(const RankWindows& w, int rank, int k) {
  const int64_t i = 2 * rank + k;
  return {w.values + i * w.capacity, w.capacity, static_cast<int64_t>(w.meta[2 * i]),
          static_cast<int64_t>(w.meta[2 * i + 1])};
}

LOCKSTEP_HD inline void rank_ring_push(const RankWindows& w, int rank, int k, double v) {
  Ring r = rank_ring(w, rank, k);
  ring_push(r, v);
  const int64_t i = 2 * rank + k;
  w.meta[2 * i] = static_cast<double>(r.head);
  w.meta[2 * i + 1] = static_cast<double>(r.size);
}

// ---- order statistics without allocation (one thread) ---------------------------------------

// A heap sort of v[0, n).
LOCKSTEP_HD inline void sort_ascending(double* v, int n) {
  const auto sift = [v](int root, int end) {
    while (2 * root + 1 < end) {
      int child = 2 * root + 1;
      if (child + 1 < end && v[child] < v[child + 1]) ++child;
      if (!(v[root] < v[child])) return;
      const double t = v[root];
      v[root] = v[child];
      v[child] = t;
      root = child;
    }
  };
  for (int i = n / 2 - 1; i >= 0; --i) sift(i, n);
  for (int end = n - 1; end > 0; --end) {
    const double t = v[0];
    v[0] = v[end];
    v[end] = t;
    sift(0, end);
  }
}

// The median of the others' values (the ((n - 1) / 2)-th smallest of the n - 1 others) for the
// one whose value is `v`, from all n values sorted.
LOCKSTEP_HD inline double median_of_others(const double* sorted, int n, double v) {
  int lo = 0, hi = n;  // the first position holding v: the one taken out
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (sorted[mid] < v) lo = mid + 1;
    else hi = mid;
  }
  const int k = (n - 1) / 2;
  return lo > k ? sorted[k] : sorted[k + 1];
}

}  // namespace lockstep::core
