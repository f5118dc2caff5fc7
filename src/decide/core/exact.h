// Exact sums of doubles: every finite double is an integer multiple of 2^-1074 below 2^1024, so
// a fixed-point number of 66 digits of 32 bits (each kept in an int64) holds any of them, and
// sums of them, without rounding. Digit-wise integer addition is associative and commutative,
// so an all-reduce of these digits in any order, on any backend, gives every rank the same
// integers, and value() rounds them once, to nearest even: the correctly rounded sum, the same
// bits as the same values added in rank order on one thread through this type. Nonfinite values
// are counted apart (IEEE's rules: a NaN or +inf with -inf gives NaN).
//
// Headroom: a value adds less than 2^32 to each digit, so up to 2^31 values (ranks) add without
// overflow.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "decide/core/windows.h"

namespace lockstep::core {

constexpr int kExactDigits = 66;  // 2112 bits: 2^-1074 to beyond 2^1024
constexpr int kExactInts = kExactDigits + 3;  // + the counts of NaN, +inf, -inf

// The digits (value = sum of d[i] * 2^(32 i - 1074)) and the nonfinite counts, as int64s that
// add element-wise.
struct ExactSum {
  int64_t d[kExactDigits];
  int64_t nan, pos_inf, neg_inf;
};

LOCKSTEP_HD inline void exact_zero(ExactSum& a) {
  for (int i = 0; i < kExactDigits; ++i) a.d[i] = 0;
  a.nan = a.pos_inf = a.neg_inf = 0;
}

// Each digit into [0, 2^32), the carries upward; the top digit keeps the sign.
LOCKSTEP_HD inline void exact_normalize(ExactSum& a) {
  for (int i = 0; i + 1 < kExactDigits; ++i) {
    const int64_t carry = a.d[i] >> 32;  // arithmetic: the floor
    a.d[i] -= carry * (int64_t{1} << 32);
    a.d[i + 1] += carry;
  }
}

LOCKSTEP_HD inline void exact_add(ExactSum& a, double x) {
  if (x != x) {
    ++a.nan;
    return;
  }
  if (std::isinf(x)) {
    ++(x > 0 ? a.pos_inf : a.neg_inf);
    return;
  }
#if defined(__CUDA_ARCH__)
  const auto u = static_cast<uint64_t>(__double_as_longlong(x));
#else
  uint64_t u;
  static_assert(sizeof u == sizeof x);
  std::memcpy(&u, &x, sizeof u);
#endif
  const int field = static_cast<int>((u >> 52) & 0x7ff);
  const uint64_t fraction = u & ((uint64_t{1} << 52) - 1);
  const uint64_t m = field == 0 ? fraction : fraction | (uint64_t{1} << 52);
  const int shift = field == 0 ? 0 : field - 1;  // the bit that m's lowest lands on
  const int q = shift / 32, o = shift % 32;  // q + 2 < kExactDigits: shift < 2046
  const uint64_t lo = (m & 0xffffffffu) << o, hi = (m >> 32) << o;  // below 2^63 and 2^52
  const int64_t sign = (u >> 63) != 0 ? -1 : 1;
  a.d[q] += sign * static_cast<int64_t>(lo & 0xffffffffu);
  a.d[q + 1] += sign * static_cast<int64_t>((lo >> 32) + (hi & 0xffffffffu));
  a.d[q + 2] += sign * static_cast<int64_t>(hi >> 32);
}

LOCKSTEP_HD inline void exact_add(ExactSum& a, const ExactSum& b) {
  for (int i = 0; i < kExactDigits; ++i) a.d[i] += b.d[i];
  a.nan += b.nan;
  a.pos_inf += b.pos_inf;
  a.neg_inf += b.neg_inf;
}

// Bit `i` of a normalized non-negative number.
LOCKSTEP_HD inline uint64_t exact_bit(const ExactSum& a, int i) {
  return i < 0 ? 0 : (static_cast<uint64_t>(a.d[i / 32]) >> (i % 32)) & 1u;
}

// Whether any bit below `i` is set.
LOCKSTEP_HD inline bool exact_any_below(const ExactSum& a, int i) {
  if (i <= 0) return false;
  for (int k = 0; k < i / 32; ++k)
    if (a.d[k] != 0) return true;
  const int o = i % 32;
  return o != 0 && (static_cast<uint64_t>(a.d[i / 32]) & ((uint64_t{1} << o) - 1)) != 0;
}

// The sum, rounded once to the nearest double (ties to even); +0 for an exact zero.
LOCKSTEP_HD inline double exact_value(ExactSum a) {
  if (a.nan > 0 || (a.pos_inf > 0 && a.neg_inf > 0)) return nan_value();
  if (a.pos_inf > 0) return inf_value();
  if (a.neg_inf > 0) return -inf_value();
  exact_normalize(a);
  const bool negative = a.d[kExactDigits - 1] < 0;
  if (negative) {
    for (int i = 0; i < kExactDigits; ++i) a.d[i] = -a.d[i];
    exact_normalize(a);
  }
  int top = -1;  // the highest set bit
  for (int i = kExactDigits - 1; i >= 0 && top < 0; --i)
    for (int b = 31; b >= 0 && a.d[i] != 0; --b)
      if ((static_cast<uint64_t>(a.d[i]) >> b) & 1u) {
        top = 32 * i + b;
        break;
      }
  if (top < 0) return 0.0;
  const int low = top - 52 > 0 ? top - 52 : 0;  // the mantissa's lowest bit (exact below 2^-1022)
  uint64_t m = 0;
  for (int i = top; i >= low; --i) m = (m << 1) | exact_bit(a, i);
  if (exact_bit(a, low - 1) != 0 && (exact_any_below(a, low - 1) || (m & 1u) != 0)) ++m;
  const double v = std::ldexp(static_cast<double>(m), low - 1074);  // 2^53 too: exact
  return negative ? -v : v;
}

}  // namespace lockstep::core
