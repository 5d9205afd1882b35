// The 4-bit block-wise Adam step (lowbit4.py's contract, reference_adam4bit_) over whole blocks,
// generic over the ISA's `Vec`. Included by adam_kernel.h after adam8bit_kernel.h, inside each SIMD
// build's own namespace; it reuses ParamStorage (stochastic rounding), AdamRule and the 8-bit
// kernel's absmax accumulator and clamp, so the element math is the one statement of it.
//
// A block (128 elements, 64 code bytes per moment) is two passes, as in the 8-bit kernel:
// dequantize each vector's codes, Adam v2 with the clamp, store the param, keep m and v in L1
// scratch and track their absmax; then quantize with the new scales. With 16 codes there is no
// gather anywhere: a vector's codes index a 16-entry table held in registers (permutexvar on
// AVX-512, two vpermps on AVX2, tbl on NEON), and the nearest code, the count of the 15 midpoints
// strictly below x, is a branchless 4-step binary search whose levels are again register tables.
// Every path performs the reference's fp32 operations in its order (-ffp-contract=off), and the
// search's comparisons are exact, so all paths agree bit for bit.
#pragma once

namespace q4 {

// The block loop's lambdas run several times per vector: inlined, so that their constants stay in
// registers (GCC otherwise calls the pair step out of line and spills around it).
#define MFA_Q4_HOT __attribute__((always_inline))

constexpr int W = Vec::W;
using F = Vec::F;
// Elements quantized per step of the second pass: one vector, or a pair (one code byte) where a
// vector holds a single element (the scalar build).
constexpr int G = W >= 2 ? W : 2;
static_assert(kQ4Block % G == 0 && kQ4Block % W == 0, "a block is whole vectors and whole code bytes");

// The midpoints of one map (kernel_table4 words 16..30) by binary-search level: the count of
// midpoints below x is 8 * (x > M7) + 4 * (x > M[c + 3]) + 2 * (x > M[c + 1]) + (x > M[c]), each
// step testing the midpoint that halves what the earlier ones left (c: the count so far). The
// vector paths index a level by r = c >> (4 - level), hence l2, l3, l4 hold every second,
// fourth and eighth midpoint from the right offsets.
struct Levels {
  float top;
  float l2[8], l3[8], l4[8];
  explicit Levels(const float* table) : top(table[16 + 7]), l2{}, l3{}, l4{} {
    const float* mid = table + 16;
    for (int r = 0; r < 2; ++r) l2[r] = mid[8 * r + 3];
    for (int r = 0; r < 4; ++r) l3[r] = mid[4 * r + 1];
    for (int r = 0; r < 8; ++r) l4[r] = mid[2 * r];
  }
};

#if defined(MFA_ISA_AVX512)
struct Dq {
  __m512 values;
  explicit Dq(const float* table) : values(_mm512_loadu_ps(table)) {}
};
// The 16 codes of elements i..i+15 (i even: 8 bytes), one per lane; a low-nibble lane keeps its
// byte's high bits too, which the table permutes (they read 4 index bits) ignore.
inline __m512i nibbles(const uint8_t* codes, int64_t i) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (i >> 1)));
  const __m512i w = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));  // byte k in lanes 2k and 2k + 1
  return _mm512_srlv_epi32(w, _mm512_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0));
}
inline F dequant(const uint8_t* codes, int64_t i, const Dq& d, F scale) {
  return _mm512_mul_ps(_mm512_permutexvar_ps(nibbles(codes, i), d.values), scale);
}
// Here the count c itself indexes the levels (16-entry permutes): level tables shifted so that
// entry c is M[c + 3], M[c + 1], M[c].
struct Quant {
  __m512 top, t2, t3, t4;
  explicit Quant(const float* table) {
    alignas(64) float m[32] = {};
    for (int k = 0; k < 15; ++k) m[k] = table[16 + k];
    top = _mm512_set1_ps(m[7]);
    t2 = _mm512_loadu_ps(m + 3);
    t3 = _mm512_loadu_ps(m + 1);
    t4 = _mm512_loadu_ps(m);
  }
};
inline __m512i code_of(F x, const Quant& q) {  // ordered comparisons: NaN counts no midpoint
  __m512i c = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(x, q.top, _CMP_GT_OQ), _mm512_set1_epi32(8));
  c = _mm512_mask_or_epi32(c, _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(c, q.t2), _CMP_GT_OQ), c,
                           _mm512_set1_epi32(4));
  c = _mm512_mask_or_epi32(c, _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(c, q.t3), _CMP_GT_OQ), c,
                           _mm512_set1_epi32(2));
  return _mm512_mask_or_epi32(c, _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(c, q.t4), _CMP_GT_OQ), c,
                              _mm512_set1_epi32(1));
}
// The zero-free linear map's count (read_table checks its midpoints are (k + 3/2) / 16, between
// codes (k + 1) / 16 and (k + 2) / 16): the midpoints below xn are the k < 16 xn - 3/2, ceil of it
// clamped to 0..15 (above, before the conversion: infinities). 16 xn is exact, and so is the
// subtraction wherever its result could reach an integer >= 0 (16 xn >= 3/4); NaN converts to
// INT_MIN (x86) or 0 (NEON), which the clamp below takes to 0.
inline __m512i linear_code_of(F x) {
  const __m512 y = _mm512_sub_ps(_mm512_mul_ps(x, _mm512_set1_ps(16.0f)), _mm512_set1_ps(1.5f));
  const __m512 top = _mm512_min_ps(_mm512_set1_ps(15.0f), y);  // NaN stays NaN (the second operand)
  return _mm512_max_epi32(_mm512_cvt_roundps_epi32(top, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC),
                          _mm512_setzero_si512());
}
// 16 codes (one per 32-bit lane) as 8 bytes: each 64-bit lane holds an even and an odd element's
// code, (even << 4) | odd lands in its low byte, and vpmovqb keeps the low bytes.
inline void pack(uint8_t* out, __m512i c) {
  const __m512i t = _mm512_or_si512(_mm512_slli_epi64(c, 4), _mm512_srli_epi64(c, 32));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm512_cvtepi64_epi8(t));
}
// The bf16 pair layout (Vec::load_pair: even elements in one vector, odd in the other) is the
// nibbles' own: 16 bytes hold the even elements' codes in their high nibbles, the odd ones' in
// the low nibbles, so a pair of vectors unpacks with one widening and one shift, and packs back
// with one shift, an or and one narrowing.
inline void dequant_pair(const uint8_t* bytes, const Dq& d, F scale, F& even, F& odd) {
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  even = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), d.values), scale);
  odd = _mm512_mul_ps(_mm512_permutexvar_ps(w, d.values), scale);
}
inline void pack_pair(uint8_t* out, __m512i even, __m512i odd) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(_mm512_or_si512(_mm512_slli_epi32(even, 4), odd)));
}
#elif defined(MFA_ISA_AVX2)
struct Dq {
  __m256 lo, hi;  // codes 0..7 and 8..15
  explicit Dq(const float* table) : lo(_mm256_loadu_ps(table)), hi(_mm256_loadu_ps(table + 8)) {}
};
inline F table16(const Dq& d, __m256i c);  // entry c (0..15) of the code values
inline __m256i nibbles(const uint8_t* codes, int64_t i) {  // as AVX-512's: 8 codes of 4 bytes
  uint32_t u;
  __builtin_memcpy(&u, codes + (i >> 1), 4);
  const __m128i b = _mm_cvtsi32_si128(int(u));
  const __m256i w = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
  return _mm256_srlv_epi32(w, _mm256_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0));
}
inline F dequant(const uint8_t* codes, int64_t i, const Dq& d, F scale) {
  return _mm256_mul_ps(table16(d, nibbles(codes, i)), scale);
}
struct Quant {
  __m256 top, l2, l3, l4;
  explicit Quant(const float* table) {
    const Levels lv(table);
    top = _mm256_set1_ps(lv.top);
    l2 = _mm256_loadu_ps(lv.l2);
    l3 = _mm256_loadu_ps(lv.l3);
    l4 = _mm256_loadu_ps(lv.l4);
  }
};
// r doubles each step and gains the comparison (a true mask is -1): r = c >> (4 - level).
inline __m256i code_of(F x, const Quant& q) {
  const auto step = [&](__m256i r, __m256 level) {
    return _mm256_sub_epi32(_mm256_add_epi32(r, r),
                            _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_permutevar8x32_ps(level, r), _CMP_GT_OQ)));
  };
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cmp_ps(x, q.top, _CMP_GT_OQ)), 31);
  return step(step(step(r, q.l2), q.l3), q.l4);
}
inline __m256i linear_code_of(F x) {  // as AVX-512's
  const __m256 y = _mm256_sub_ps(_mm256_mul_ps(x, _mm256_set1_ps(16.0f)), _mm256_set1_ps(1.5f));
  const __m256 top = _mm256_min_ps(_mm256_set1_ps(15.0f), y);
  return _mm256_max_epi32(_mm256_cvttps_epi32(_mm256_round_ps(top, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC)),
                          _mm256_setzero_si256());
}
inline F table16(const Dq& d, __m256i c) {  // vpermps reads 3 index bits; bit 3, in the sign, picks the half
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(d.lo, c), _mm256_permutevar8x32_ps(d.hi, c),
                          _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
}
inline void dequant_pair(const uint8_t* bytes, const Dq& d, F scale, F& even, F& odd) {  // as AVX-512's
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  even = _mm256_mul_ps(table16(d, _mm256_srli_epi32(w, 4)), scale);
  odd = _mm256_mul_ps(table16(d, w), scale);
}
inline void pack_pair(uint8_t* out, __m256i even, __m256i odd) {
  const __m256i t = _mm256_or_si256(_mm256_slli_epi32(even, 4), odd);
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(w, w));
}
inline void pack(uint8_t* out, __m256i c) {  // as AVX-512's: the 4 low bytes of the 64-bit lanes
  const __m256i t = _mm256_or_si256(_mm256_slli_epi64(c, 4), _mm256_srli_epi64(c, 32));
  __m128i w = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(t, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
  w = _mm_packus_epi16(_mm_packus_epi32(w, w), w);
  const uint32_t u = uint32_t(_mm_cvtsi128_si32(w));
  __builtin_memcpy(out, &u, 4);
}
#elif defined(MFA_ISA_NEON)
struct Dq {
  uint8x16x4_t values;  // the 16 code values as 64 table bytes
  explicit Dq(const float* table) {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(table);
    values = uint8x16x4_t{{vld1q_u8(b), vld1q_u8(b + 16), vld1q_u8(b + 32), vld1q_u8(b + 48)}};
  }
};
// Byte indices 4r..4r+3 of each lane's table entry r.
inline uint8x16_t entry_bytes(uint32x4_t r) {
  return vreinterpretq_u8_u32(vmlaq_n_u32(vdupq_n_u32(0x03020100u), r, 0x04040404u));
}
inline F dequant(const uint8_t* codes, int64_t i, const Dq& d, F scale) {
  uint16_t h;  // bytes i/2 and i/2 + 1: codes of elements i..i+3 in nibbles 1, 0, 3, 2
  __builtin_memcpy(&h, codes + (i >> 1), 2);
  const int32x4_t shift = {-4, 0, -12, -8};
  const uint32x4_t c = vandq_u32(vshlq_u32(vdupq_n_u32(h), shift), vdupq_n_u32(15));
  return vmulq_f32(vreinterpretq_f32_u8(vqtbl4q_u8(d.values, entry_bytes(c))), scale);
}
struct Quant {
  float32x4_t top;
  uint8x16x2_t l2, l3, l4;
  static uint8x16x2_t bytes8(const float* t) {
    return uint8x16x2_t{{vreinterpretq_u8_f32(vld1q_f32(t)), vreinterpretq_u8_f32(vld1q_f32(t + 4))}};
  }
  explicit Quant(const float* table) {
    const Levels lv(table);
    top = vdupq_n_f32(lv.top);
    l2 = bytes8(lv.l2);
    l3 = bytes8(lv.l3);
    l4 = bytes8(lv.l4);
  }
};
inline uint32x4_t code_of(F x, const Quant& q) {  // AVX2's steps, the levels by tbl
  const auto step = [&](uint32x4_t r, const uint8x16x2_t& level) {
    return vsubq_u32(vaddq_u32(r, r), vcgtq_f32(x, vreinterpretq_f32_u8(vqtbl2q_u8(level, entry_bytes(r)))));
  };
  const uint32x4_t r = vshrq_n_u32(vcgtq_f32(x, q.top), 31);
  return step(step(step(r, q.l2), q.l3), q.l4);
}
inline uint32x4_t linear_code_of(F x) {  // as AVX-512's; vcvtpq converts NaN to 0
  const float32x4_t y = vsubq_f32(vmulq_f32(x, vdupq_n_f32(16.0f)), vdupq_n_f32(1.5f));
  const int32x4_t c = vmaxq_s32(vcvtpq_s32_f32(vminq_f32(y, vdupq_n_f32(15.0f))), vdupq_n_s32(0));
  return vreinterpretq_u32_s32(c);
}
inline void pack(uint8_t* out, uint32x4_t c) {  // AVX-512's pairing in 64-bit lanes, then their low bytes
  const uint64x2_t c64 = vreinterpretq_u64_u32(c);
  const uint64x2_t t = vorrq_u64(vshlq_n_u64(c64, 4), vshrq_n_u64(c64, 32));
  const uint8x16_t low = {0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8};
  const uint16_t h = vgetq_lane_u16(vreinterpretq_u16_u8(vqtbl1q_u8(vreinterpretq_u8_u64(t), low)), 0);
  __builtin_memcpy(out, &h, 2);
}
#else
// One element at a time: the contract's definitions themselves.
struct Dq {
  float values[16];
  explicit Dq(const float* table) { __builtin_memcpy(values, table, sizeof values); }
};
inline F dequant(const uint8_t* codes, int64_t i, const Dq& d, F scale) {
  const unsigned c = (unsigned(codes[i >> 1]) >> ((i & 1) ? 0 : 4)) & 15u;
  return d.values[c] * scale;
}
struct Quant {
  float mid[15];
  explicit Quant(const float* table) { __builtin_memcpy(mid, table + 16, sizeof mid); }
};
inline unsigned code_of(float x, const Quant& q) {  // midpoints strictly below x; NaN: none
  unsigned c = 0;
  for (int k = 0; k < 15; ++k) c += q.mid[k] < x ? 1u : 0u;
  return c;
}
inline unsigned linear_code_of(float x, const Quant& q) { return code_of(x, q); }
#endif

#if defined(MFA_ISA_AVX512) || defined(MFA_ISA_AVX2) || defined(MFA_ISA_NEON)
// The code of xn on the first moment's map (Signed) or the second's.
template <bool Signed>
inline auto code(F xn, const Quant& q) {
  if constexpr (Signed) return code_of(xn, q);
  else return linear_code_of(xn);
}
#else
template <bool Signed>
inline unsigned code(float xn, const Quant& q) { return Signed ? code_of(xn, q) : linear_code_of(xn, q); }
#endif

// Codes of the G scratch values x[0..G) times inv, elements i..i+G-1 (i even), as G / 2 bytes.
template <bool Signed>
inline void quantize(uint8_t* codes, int64_t i, const float* x, F inv, const Quant& q) {
#if defined(MFA_ISA_AVX512) || defined(MFA_ISA_AVX2) || defined(MFA_ISA_NEON)
  pack(codes + (i >> 1), code<Signed>(Vec::load(x) * inv, q));
#else
  codes[i >> 1] = uint8_t((code<Signed>(x[0] * inv, q) << 4) | code<Signed>(x[1] * inv, q));
#endif
}

// Blocks [b0, b1): the 4-bit step of lowbit4.py, one block after another. bf16 params on the
// x86 paths go as pairs of vectors (even and odd elements, Vec::load_pair), whose codes are the
// bytes' high and low nibbles (dequant_pair); the scratch then holds each pair's even vector
// before its odd one, which the absmax does not see and the second pass reads back alike.
template <class PS>
__attribute__((flatten)) void adam4bit_blocks(const Q4Job& job, int64_t b0, int64_t b1) {
  using P = typename ParamStorage<PS>::T;
#if defined(MFA_ISA_AVX512) || defined(MFA_ISA_AVX2)
  constexpr bool kPairs = std::is_same<P, bf16>::value;
#else
  constexpr bool kPairs = false;
#endif
  const bool pairs = kPairs && bf16_pairs();
  const Adam8bitScalars& s = job.s;
  const AdamRule adam(s);
  const F clip = Vec::set1(s.clip), nclip = Vec::set1(-s.clip);
  // Locals, not job fields: byte stores may alias anything, so fields would be reloaded.
  P* const param = static_cast<P*>(job.param);
  const P* const grad = static_cast<const P*>(job.grad);
  uint8_t* const codes1 = job.codes1;
  uint8_t* const codes2 = job.codes2;
  float* const absmax1 = job.absmax1;
  float* const absmax2 = job.absmax2;
  const int64_t n = job.n;
  const uint32_t sr_key = job.sr_key;
  const Dq dq1(job.map1), dq2(job.map2);
  const Quant quant1(job.map1), quant2(job.map2);
  alignas(64) float mb[kQ4Block + 2 * W], vb[kQ4Block + 2 * W];
  const auto clamp = [&](F u) MFA_Q4_HOT { return q8::clamp(u, nclip, clip); };
  // One vector: dequantize (codes at element ci of c1/c2), Adam v2 with the clamp, store the
  // param; m and v come back.
  auto update = [&](P* pp, const P* gp, const uint8_t* c1, const uint8_t* c2, int64_t ci, int64_t index, F a1,
                    F a2, F& m, F& v) MFA_Q4_HOT {
    F p = Vec::load(pp), g = Vec::load(gp);
    m = dequant(c1, ci, dq1, a1);
    v = dequant(c2, ci, dq2, a2);
    adam.step(p, g, m, v, clamp);
    ParamStorage<PS>::store(pp, p, sr_key, index);
  };
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * kQ4Block;
    const int len = int(n - lo < kQ4Block ? n - lo : kQ4Block);
    const F a1 = Vec::set1(absmax1[b]), a2 = Vec::set1(absmax2[b]);
    q8::Acc mx1 = q8::acc_zero(), mx2 = q8::acc_zero();
    int j = 0;
#if defined(MFA_ISA_AVX512) || defined(MFA_ISA_AVX2)
    if constexpr (kPairs) {
      if (pairs) {
        // 2W elements from 2W params, grads and W code bytes of each moment (at element jj of pp, gp
        // and byte jj / 2 of c1, c2); writes the param and the scratch at j.
        // Named vectors, not arrays: GCC kept arrays of them on the stack.
        auto update_pair = [&](P* pp, const P* gp, const uint8_t* c1, const uint8_t* c2, int64_t index, F& m0, F& m1,
                               F& v0, F& v1) MFA_Q4_HOT {
          F p0, p1, g0, g1;
          Vec::load_pair(pp, p0, p1);
          Vec::load_pair(gp, g0, g1);
          dequant_pair(c1, dq1, a1, m0, m1);
          dequant_pair(c2, dq2, a2, v0, v1);
          adam.step(p0, g0, m0, v0, clamp);
          adam.step(p1, g1, m1, v1, clamp);
          ParamStorage<PS>::store_pair(pp, p0, p1, sr_key, index);
          Vec::store(mb + j, m0);
          Vec::store(mb + j + W, m1);
          Vec::store(vb + j, v0);
          Vec::store(vb + j + W, v1);
        };
        for (; j + 2 * W <= len; j += 2 * W) {
          F m0, m1, v0, v1;
          update_pair(param + lo + j, grad + lo + j, codes1 + (lo + j) / 2, codes2 + (lo + j) / 2, lo + j, m0, m1,
                      v0, v1);
          mx1 = q8::acc_max(q8::acc_max(mx1, m0), m1);
          mx2 = q8::acc_max(q8::acc_max(mx2, v0), v1);
        }
        if (const int r = len - j; r > 0) {
          // A short last pair on zero-padded copies; its pad elements (even lane k is element 2k,
          // odd lane k element 2k + 1) are zeroed before they could reach the absmax.
          P pb[2 * W] = {}, gb[2 * W] = {};
          uint8_t cb1[W] = {}, cb2[W] = {};
          for (int k = 0; k < r; ++k) {
            pb[k] = param[lo + j + k];
            gb[k] = grad[lo + j + k];
          }
          for (int k = 0; k < (r + 1) / 2; ++k) {
            cb1[k] = codes1[(lo + j) / 2 + k];
            cb2[k] = codes2[(lo + j) / 2 + k];
          }
          F m0, m1, v0, v1;
          update_pair(pb, gb, cb1, cb2, lo + j, m0, m1, v0, v1);
          for (int k = 0; k < r; ++k) param[lo + j + k] = pb[k];
          for (int k = 0; k < W; ++k) {
            if (2 * k >= r) mb[j + k] = vb[j + k] = 0.0f;
            if (2 * k + 1 >= r) mb[j + W + k] = vb[j + W + k] = 0.0f;
          }
          for (int h = 0; h < 2; ++h) {
            mx1 = q8::acc_max(mx1, Vec::load(mb + j + h * W));
            mx2 = q8::acc_max(mx2, Vec::load(vb + j + h * W));
          }
        }
      }
    }
#endif
    if (!pairs) {
      for (; j + W <= len; j += W) {
        F m, v;
        update(param + lo + j, grad + lo + j, codes1, codes2, lo + j, lo + j, a1, a2, m, v);
        Vec::store(mb + j, m);
        Vec::store(vb + j, v);
        mx1 = q8::acc_max(mx1, m);
        mx2 = q8::acc_max(mx2, v);
      }
      if (const int r = len - j; r > 0) {
        // A short last vector (vector paths) through the same math on zero-padded copies; its pad
        // lanes are zeroed before they could reach the absmax.
        P pb[W] = {}, gb[W] = {};
        uint8_t cb1[W] = {}, cb2[W] = {};
        for (int k = 0; k < r; ++k) {
          pb[k] = param[lo + j + k];
          gb[k] = grad[lo + j + k];
        }
        for (int k = 0; k < (r + 1) / 2; ++k) {
          cb1[k] = codes1[(lo + j) / 2 + k];
          cb2[k] = codes2[(lo + j) / 2 + k];
        }
        F m, v;
        update(pb, gb, cb1, cb2, 0, lo + j, a1, a2, m, v);
        for (int k = 0; k < r; ++k) param[lo + j + k] = pb[k];
        Vec::store(mb + j, m);
        Vec::store(vb + j, v);
        for (int k = r; k < W; ++k) mb[j + k] = vb[j + k] = 0.0f;
        mx1 = q8::acc_max(mx1, Vec::load(mb + j));
        mx2 = q8::acc_max(mx2, Vec::load(vb + j));
      }
    }
    // The absmax as the reference's amax of |x| (adam8bit_kernel.h says why the bit patterns).
    const float s1 = q8::from_bits(q8::acc_reduce(mx1)), s2 = q8::from_bits(q8::acc_reduce(mx2));
    const F inv1 = Vec::set1(s1 == 0.0f ? 0.0f : 1.0f / s1), inv2 = Vec::set1(s2 == 0.0f ? 0.0f : 1.0f / s2);
    // Codes of the scratch from j on, elements lo + j.. into c1 and c2 (G elements, or a pair).
    auto requantize = [&](uint8_t* c1, uint8_t* c2, int64_t i, int jj) MFA_Q4_HOT {
#if defined(MFA_ISA_AVX512) || defined(MFA_ISA_AVX2)
      if (pairs) {
        pack_pair(c1 + (i >> 1), code<true>(Vec::load(mb + jj) * inv1, quant1),
                  code<true>(Vec::load(mb + jj + W) * inv1, quant1));
        pack_pair(c2 + (i >> 1), code<false>(Vec::load(vb + jj) * inv2, quant2),
                  code<false>(Vec::load(vb + jj + W) * inv2, quant2));
        return;
      }
#endif
      quantize<true>(c1, i, mb + jj, inv1, quant1);
      quantize<false>(c2, i, vb + jj, inv2, quant2);
    };
    const int step = pairs ? 2 * W : G;
    if (!pairs)  // the scalar build's odd length (the vector paths zeroed their pad lanes above)
      for (int k = len; k % step; ++k) mb[k] = vb[k] = 0.0f;
    for (j = 0; j + step <= len; j += step) requantize(codes1, codes2, lo + j, j);
    if (j < len) {
      // The short last block's last codes: whole bytes only; an odd length's last byte keeps
      // its low nibble 0 (the contract's pad).
      uint8_t q1[W] = {}, q2[W] = {};  // step / 2 <= W bytes
      requantize(q1, q2, 0, j);
      const int bytes = (len - j + 1) / 2;
      if ((len - j) & 1) {
        q1[bytes - 1] &= 0xF0;
        q2[bytes - 1] &= 0xF0;
      }
      for (int k = 0; k < bytes; ++k) {
        codes1[(lo + j) / 2 + k] = q1[k];
        codes2[(lo + j) / 2 + k] = q2[k];
      }
    }
    absmax1[b] = s1;
    // +inf stored as the NaN 0xFFC00000 (lowbit4.stored_scale2): fixed bits, since the sign of a
    // NaN made by arithmetic is the CPU's.
    uint32_t s2_bits;
    __builtin_memcpy(&s2_bits, &s2, 4);
    absmax2[b] = s2_bits == 0x7F800000u ? q8::from_bits(0xFFC00000u) : s2;
  }
}

// The memory floor of the 4-bit step (bench), as adam8bit_floor_blocks: per block the same bytes
// read and written (param, grad, both code arrays, both scales), trivial math that keeps every value.
template <class PS>
void adam4bit_floor_blocks(const Q4Job& job, int64_t b0, int64_t b1) {
  using P = typename ParamStorage<PS>::T;
  P* const param = static_cast<P*>(job.param);
  const P* const grad = static_cast<const P*>(job.grad);
  uint8_t* const codes1 = job.codes1;
  uint8_t* const codes2 = job.codes2;
  float* const absmax1 = job.absmax1;
  float* const absmax2 = job.absmax2;
  const int64_t n = job.n;
  const float zero = job.s.weight_decay - job.s.weight_decay;
  const F zv = Vec::set1(zero);
  const uint8_t zc = uint8_t(int(zero));  // from the float: an integer x - x would fold to 0
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * kQ4Block;
    const int64_t hi = n - lo < kQ4Block ? n : lo + kQ4Block;
    int64_t i = lo;
    for (; i + W <= hi; i += W) Vec::store(param + i, Vec::load(param + i) + Vec::load(grad + i) * zv);
    if (i < hi) {
      P pb[W] = {}, gb[W] = {};
      const int64_t r = hi - i;
      for (int64_t k = 0; k < r; ++k) {
        pb[k] = param[i + k];
        gb[k] = grad[i + k];
      }
      Vec::store(pb, Vec::load(pb) + Vec::load(gb) * zv);
      for (int64_t k = 0; k < r; ++k) param[i + k] = pb[k];
    }
    for (i = lo / 2; i < (hi + 1) / 2; ++i) codes1[i] = uint8_t(codes1[i] + zc);
    for (i = lo / 2; i < (hi + 1) / 2; ++i) codes2[i] = uint8_t(codes2[i] + zc);
    absmax1[b] = absmax1[b] + zero;
    absmax2[b] = absmax2[b] + zero;
  }
}

// Packed codes of x[0..n) (xn = x * 1, exact) on one map, as the step's second pass codes them.
template <bool Signed>
void quantize_map(const float* x, int64_t n, const float* table, uint8_t* out) {
  const Quant q(table);
  const F one = Vec::set1(1.0f);
  int64_t i = 0;
  for (; i + G <= n; i += G) quantize<Signed>(out, i, x + i, one, q);
  if (i < n) {
    alignas(64) float t[G] = {};
    uint8_t c[G / 2];
    for (int64_t k = 0; k < n - i; ++k) t[k] = x[i + k];
    quantize<Signed>(c, 0, t, one, q);
    for (int64_t k = 0; k < (n - i + 1) / 2; ++k) out[i / 2 + k] = c[k];
    if ((n - i) & 1) out[(n - 1) / 2] &= 0xF0;
  }
}
inline void quantize_n(const float* x, int64_t n, const float* table, uint8_t* out) {
  (table[0] < 0.0f ? quantize_map<true> : quantize_map<false>)(x, n, table, out);
}

}  // namespace q4

inline void fill_adam4bit(IsaTable& t) {
  t.q4_quantize = q4::quantize_n;
  t.adam4bit[int(Q8Param::F32)] = q4::adam4bit_blocks<float>;
  t.adam4bit[int(Q8Param::F16)] = q4::adam4bit_blocks<mfa::f16>;
  t.adam4bit[int(Q8Param::BF16)] = q4::adam4bit_blocks<mfa::bf16>;
  t.adam4bit[int(Q8Param::BF16SR)] = q4::adam4bit_blocks<mfa::bf16sr>;
  t.adam4bit_floor[int(Q8Param::F32)] = q4::adam4bit_floor_blocks<float>;
  t.adam4bit_floor[int(Q8Param::F16)] = q4::adam4bit_floor_blocks<mfa::f16>;
  t.adam4bit_floor[int(Q8Param::BF16)] = q4::adam4bit_floor_blocks<mfa::bf16>;
  t.adam4bit_floor[int(Q8Param::BF16SR)] = q4::adam4bit_floor_blocks<mfa::bf16>;
}
