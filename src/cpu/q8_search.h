// The nearest-code search of the 8-bit maps, one value at a time (lowbit.py, "The kernels'
// quantizer"): the definition the SIMD paths follow, and their fallback for lanes whose estimate
// lies too close to a midpoint. Internal linkage: each SIMD build compiles its own copy with its
// own flags (an inline function shared across builds could run AVX-512 code on any CPU).
#pragma once
#include <cstdint>

namespace mfa {
namespace {

inline uint32_t q8_bits(float x) { uint32_t u; __builtin_memcpy(&u, &x, 4); return u; }
inline float q8_float(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }

// Binades [2^-31, 2^-30) .. [1, 2) as 0..31; smaller values share 0, larger ones 31.
inline uint32_t q8_binade(uint32_t z) {
  const uint32_t e = z >> 23;
  return (e < 96 ? 96 : e > 127 ? 127 : e) - 96;
}

// Region of z (fp32 bits of a value >= 0, or one ulp above one): how many region boundaries lie
// strictly below it (each binade holds at most one).
inline uint32_t q8_region(uint32_t z, const Q8Map& m) {
  const uint32_t k = q8_binade(z);
  return uint32_t(m.region[k]) + (z > m.boundary[k] ? 1u : 0u);
}

// The region's affine estimate of the count: two fp32 roundings, as every path computes it.
inline float q8_estimate(uint32_t z, uint32_t r, const Q8Map& m) {
  const float t = q8_float(z) * m.a[r];
  return t - m.c[r];
}

// The number of positive-half midpoints strictly below z, exactly: the estimate picks the one
// midpoint worth testing (its error is far below half a code), one comparison decides.
inline uint32_t q8_count(uint32_t z, const Q8Map& m) {
  const uint32_t r = q8_region(z, m);
  float j = __builtin_rintf(q8_estimate(z, r, m)) - 1.0f;
  if (!(j >= m.jlo[r])) j = m.jlo[r];  // NaN (z = inf in region 8) too
  if (j > m.jhi[r]) j = m.jhi[r];
  const uint32_t k = j < float(m.top) ? uint32_t(j) : m.top;  // region 8's count N + 1 is M_N's test
  return k + (z > m.mid_bits[k] ? 1u : 0u);
}

// The contract's code of x: the number of the map's midpoints strictly below x, NaN -> 0, with
// positive_floor a positive x never the zero code. The signed map is symmetric (M below zero are
// -M above it), so for x < 0 the midpoints below x are those above |x| excluded ones equal to it:
// 127 minus the count of M_j <= |x|, j < N, which is the count below |x|'s next fp32.
inline uint8_t q8_code(float x, const Q8Map& m, bool positive_floor) {
  if (x != x) return 0;
  const uint32_t u = q8_bits(x), y = u & 0x7FFFFFFFu;
  const bool neg = (u >> 31) != 0;
  uint32_t c;
  if (m.is_signed) {
    if (neg) {
      const uint32_t p = q8_count(y + 1, m);
      c = m.zero - (p < m.zero ? p : m.zero);
    } else {
      c = m.zero + q8_count(y, m);
    }
  } else {
    c = neg ? 0 : q8_count(y, m);
  }
  if (positive_floor && c == 0 && x > 0.0f) c = 1;
  return uint8_t(c);
}

}  // namespace
}  // namespace mfa
