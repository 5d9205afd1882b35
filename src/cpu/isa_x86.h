// x86 vector layers: AVX2 (+F16C) and AVX-512F (+BF16 where built with it). Compiled only in the
// TUs built with those flags.
#pragma once

// (included by adam_<isa>.cpp inside its namespace, after the system headers)

#if defined(MFA_ISA_AVX2)
struct Vec {
  static constexpr int W = 8;
  using F = __m256;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F sqrt(F x) { return _mm256_sqrt_ps(x); }
  static F neg(F x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }
  // Lion's sign: 1 where x > 0, -1 where x < 0, else x - x (+0 for both zeros, NaN for NaN).
  static F sign(F x) {
    const F zero = _mm256_setzero_ps();
    F s = _mm256_sub_ps(x, x);
    s = _mm256_blendv_ps(s, _mm256_set1_ps(1.0f), _mm256_cmp_ps(x, zero, _CMP_GT_OQ));
    return _mm256_blendv_ps(s, _mm256_set1_ps(-1.0f), _mm256_cmp_ps(x, zero, _CMP_LT_OQ));
  }
  // lr * sign(x) for an lr whose sign bit is clear, in the same bits: lr with x's sign bit where
  // x is neither zero nor NaN (lr * 1 and lr * -1 are exact), else x - x (+0 = lr * +0; NaN).
  static F signed_lr(F lr, F x) {
    const F bits = _mm256_xor_ps(_mm256_and_ps(x, _mm256_set1_ps(-0.0f)), lr);
    return _mm256_blendv_ps(bits, _mm256_sub_ps(x, x), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_EQ_UQ));
  }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F load(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(f16* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static F load(const bf16* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  // bf16 bits of x rounded to nearest even (as torch does), in the low half of each 32-bit lane;
  // any NaN becomes torch's 0x7FC0.
  static __m256i bf16_bits(F x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  }
  static void store(bf16* p, F x) {
    __m256i r = bf16_bits(x);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  // 2W bf16 values as two vectors of their even and odd elements: one load and two bit operations
  // instead of two widening loads, and no packing on the way back. The rules are elementwise, so
  // the lane order is free as long as every stream of a loop uses the same (adam_kernel.h).
  static constexpr bool kBf16Pairs = true;
  static void load_pair(const bf16* p, F& even, F& odd) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xFFFF0000u))));
  }
  static void store_pair(bf16* p, F even, F odd) {
    const __m256i w = _mm256_or_si256(_mm256_slli_epi32(bf16_bits(odd), 16), bf16_bits(even));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w);
  }
};
#elif defined(MFA_ISA_AVX512)
struct Vec {
  static constexpr int W = 16;
  using F = __m512;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F sqrt(F x) { return _mm512_sqrt_ps(x); }
  static F neg(F x) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
  }
  // Lion's sign: 1 where x > 0, -1 where x < 0, else x - x (+0 for both zeros, NaN for NaN).
  static F sign(F x) {
    const F zero = _mm512_setzero_ps();
    F s = _mm512_sub_ps(x, x);
    s = _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
    return _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
  }
  // lr * sign(x) for an lr whose sign bit is clear, in the same bits: lr with x's sign bit where
  // x is neither zero nor NaN (one vpternlogd), else x - x (+0 = lr * +0; NaN): 3 operations
  // instead of sign()'s 5 and a multiply (Lion in bf16 at 16 threads on the Xeon: 0.94 to 1.00 of
  // the floor against 0.92 to 0.98 with the product, rule_math_xeon16.txt in commit 9f0d440, docs/experiments.md).
  static F signed_lr(F lr, F x) {
    const __m512i bits = _mm512_ternarylogic_epi32(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN),
                                                   _mm512_castps_si512(lr), 0x6A);  // (x & sign) ^ lr
    return _mm512_mask_sub_ps(_mm512_castsi512_ps(bits), _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_UQ), x, x);
  }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F load(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(f16* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static F load(const bf16* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  // The exact integer rounding (every input, denormals and NaN included): bf16 bits of x rounded
  // to nearest even in the low half of each 32-bit lane, any NaN as torch's 0x7FC0.
  static __m512i bf16_bits(F x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  }
#if defined(__AVX512BF16__)
  // vcvtneps2bf16 rounds to nearest even as torch does, in one instruction, but it flushes
  // denormals and keeps NaN signs and payloads (torch writes 0x7FC0): vectors holding either,
  // rare in training, take the exact integer path.
  static __mmask16 cvtne_inexact(F x) { return _mm512_fpclass_ps_mask(x, 0xA1); }  // qNaN | denormal | sNaN
#endif
  static void store(bf16* p, F x) {
#if defined(__AVX512BF16__)
    if (cvtne_inexact(x) == 0) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
      return;
    }
#endif
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
  }
  // 2W bf16 values as two vectors of their even and odd elements: one load and two bit operations
  // instead of two widening loads (faster on the 2-core EPYC and the 16-core Xeon: docs/benchmarks.md,
  // "Figures behind the code"). The rules are
  // elementwise, so the lane order is free as long as every stream of a loop uses the same
  // (adam_kernel.h).
  static constexpr bool kBf16Pairs = true;
  static void load_pair(const bf16* p, F& even, F& odd) {
    const __m512i w = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int(0xFFFF0000u))));
  }
  static void store_pair(bf16* p, F even, F odd) {
#if defined(__AVX512BF16__)
    if ((cvtne_inexact(even) | cvtne_inexact(odd)) == 0) {
      // Both vectors in one instruction (even's values in the low half), then interleaved back.
      const __m512i c = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
      const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                             22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      _mm512_storeu_si512(p, _mm512_permutexvar_epi16(order, c));
      return;
    }
#endif
    _mm512_storeu_si512(p, _mm512_or_si512(_mm512_slli_epi32(bf16_bits(odd), 16), bf16_bits(even)));
  }
};
#endif
