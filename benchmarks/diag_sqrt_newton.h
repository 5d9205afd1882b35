// The benchmarks' correctly rounded square root from vrsqrt14ps (diag_rule_math.cpp,
// diag_sqrt_split.cpp): one Goldschmidt step, then a correction from the exact residual
// x - s * s (fused multiply-adds); inputs below 2^-100 scaled by 2^64 so the residual cannot lose
// bits to underflow. Each harness checks it against vsqrtps over all 2^32 inputs before timing.
// Not shipped: it was slower than vsqrtps in the real kernels (README, "Benchmarks (CPU)").
#pragma once
#include <immintrin.h>

static inline __m512 sqrt_newton(__m512 x0) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x0, _mm512_set1_ps(0x1p-100f), _CMP_LT_OQ);
  const __m512 x = _mm512_mask_mul_ps(x0, tiny, x0, _mm512_set1_ps(0x1p64f));
  const __m512 y = _mm512_rsqrt14_ps(x);
  __m512 s = _mm512_mul_ps(x, y);
  __m512 h = _mm512_mul_ps(y, _mm512_set1_ps(0.5f));
  const __m512 r = _mm512_fnmadd_ps(s, h, _mm512_set1_ps(0.5f));
  s = _mm512_fmadd_ps(s, r, s);
  h = _mm512_fmadd_ps(h, r, h);
  s = _mm512_fmadd_ps(_mm512_fnmadd_ps(s, s, x), h, s);
  s = _mm512_mask_mul_ps(s, tiny, s, _mm512_set1_ps(0x1p-32f));
  return _mm512_mask_mov_ps(s, _mm512_fpclass_ps_mask(x0, 0x0E), x0);  // +-0, +inf
}

// How many of the 2^32 float inputs sqrt_newton gives other bits for than vsqrtps (NaNs compared
// by their bits too): the harnesses time it only when this is 0.
static inline unsigned long long sqrt_newton_mismatches() {
  alignas(64) unsigned in[16];
  unsigned long long bad = 0;
  for (unsigned long long b = 0; b < (1ull << 32); b += 16) {
    for (int k = 0; k < 16; ++k) in[k] = unsigned(b + unsigned(k));
    const __m512 x = _mm512_load_ps(reinterpret_cast<const float*>(in));
    bad += unsigned(__builtin_popcount(_mm512_cmpneq_epi32_mask(_mm512_castps_si512(_mm512_sqrt_ps(x)),
                                                                _mm512_castps_si512(sqrt_newton(x)))));
  }
  return bad;
}
