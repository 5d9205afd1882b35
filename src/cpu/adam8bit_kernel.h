// The 8-bit block-wise Adam step (lowbit.py's contract, reference_lowbit.py) over whole blocks,
// generic over the ISA's `Vec`. Included by each adam_<isa>.cpp after adam_kernel.h (it reuses
// ParamStorage, so stochastic rounding is the span loop's), inside that build's own namespace.
//
// A block is two passes over L1-resident scratch: dequantize, Adam v2 with the clamp, store the
// param, and track each moment's absmax; then requantize with the new scales. The three table
// operations (dequantize, absmax, nearest code) are the only ISA-specific parts: byte permutes
// (dequantize, with AVX512_VBMI) or gathers on x86, a lane loop elsewhere; the nearest code is
// arithmetic on the maps' structure everywhere (q8_search.h), with no table gather. Every path performs
// the reference's fp32 operations in its order (built with -ffp-contract=off), so all paths agree
// bit for bit.
#pragma once

namespace q8 {

constexpr int W = Vec::W;
using F = Vec::F;

// The search runs twice per vector: inlined, so that its constants stay in registers (as a call
// it reloaded them and realigned the stack each time). The lanes it is unsure of go out of line.
#define MFA_Q8_HOT inline __attribute__((always_inline))
__attribute__((noinline, cold)) inline void recheck(uint8_t* out, const float* x, unsigned lanes, const Q8Map& map,
                                                    bool positive_floor) {
  for (; lanes; lanes &= lanes - 1) out[__builtin_ctz(lanes)] = q8_code(x[__builtin_ctz(lanes)], map, positive_floor);
}

#if defined(MFA_ISA_AVX512)
using Acc = __m512i;  // running max of |x|'s bit patterns
inline Acc acc_zero() { return _mm512_setzero_si512(); }
inline F dequant(const uint8_t* c, const float* values, F scale) {
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  return _mm512_mul_ps(_mm512_i32gather_ps(idx, values, 4), scale);
}
#if defined(__AVX512VBMI__)
// A whole block's codes through the map, 64 at a time: each byte of the code values comes from
// two 128-entry byte permutes chosen by index bit 7 (Q8Map::bytes), and unpacking the four byte
// planes yields the values. A gather per 16 codes cost more: diag_q8_dequant.py, docs/experiments.md.
constexpr bool kBlockDequant = true;
inline void dequant_block(const uint8_t* c, const Q8Map& map, float scale, float* out) {
  // Unpacking works within 128-bit lanes: byte 16L+4q+j (L, q, j < 4) of the index vector takes
  // code 16q+4L+j, so that the four unpacked vectors hold codes 0..15, 16..31, 32..47, 48..63.
  alignas(64) static const uint8_t order_bytes[64] = {
#define MFA_Q8_LANE(L)                                                                                    \
  0 + 4 * L, 1 + 4 * L, 2 + 4 * L, 3 + 4 * L, 16 + 4 * L, 17 + 4 * L, 18 + 4 * L, 19 + 4 * L, 32 + 4 * L, \
      33 + 4 * L, 34 + 4 * L, 35 + 4 * L, 48 + 4 * L, 49 + 4 * L, 50 + 4 * L, 51 + 4 * L
      MFA_Q8_LANE(0), MFA_Q8_LANE(1), MFA_Q8_LANE(2), MFA_Q8_LANE(3)};
#undef MFA_Q8_LANE
  const __m512i order = _mm512_load_si512(order_bytes);
  const __m512i* t = reinterpret_cast<const __m512i*>(map.bytes);
  const F s = _mm512_set1_ps(scale);
  for (int j = 0; j < kQ8Block; j += 64) {
    const __m512i idx = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(c + j));
    const __mmask64 high = _mm512_movepi8_mask(idx);
    __m512i plane[4];
    for (int k = 0; k < 4; ++k) {
      const __m512i* tk = t + 4 * k;
      plane[k] = _mm512_mask_blend_epi8(
          high, _mm512_permutex2var_epi8(_mm512_loadu_si512(tk), idx, _mm512_loadu_si512(tk + 1)),
          _mm512_permutex2var_epi8(_mm512_loadu_si512(tk + 2), idx, _mm512_loadu_si512(tk + 3)));
    }
    const __m512i lo01 = _mm512_unpacklo_epi8(plane[0], plane[1]), hi01 = _mm512_unpackhi_epi8(plane[0], plane[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(plane[2], plane[3]), hi23 = _mm512_unpackhi_epi8(plane[2], plane[3]);
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23)), s));
    _mm512_storeu_ps(out + j + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23)), s));
    _mm512_storeu_ps(out + j + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23)), s));
    _mm512_storeu_ps(out + j + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23)), s));
  }
}
#else
constexpr bool kBlockDequant = false;  // no byte permutes: the per-vector gather
inline void dequant_block(const uint8_t*, const Q8Map&, float, float*) {}
#endif
inline Acc acc_max(Acc a, F x) {
  return _mm512_max_epu32(a, _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)));
}
inline uint32_t acc_reduce(Acc a) { return _mm512_reduce_max_epu32(a); }
inline F clamp(F u, F lo, F hi) {  // NaN stays NaN: min/max return their second operand then
  return _mm512_max_ps(lo, _mm512_min_ps(hi, u));
}
// The nearest-code search (q8_search.h) on 16 lanes without a table load: the region from the
// binade (two 32-entry permutes and one comparison), the region's constants by permutes, and the
// count as floor(estimate), exact for every lane whose estimate lies further than Q8Map::unsure
// from an integer; the few others (about 3 in 100,000) take q8_code.
template <bool Signed>
struct Quant {
  const Q8Map* map;
  __m512 a, c, jhi, unsure;
  __m512i region0, region1, bound0, bound1, lowest, highest, one, zero, add0, add1, bottom;
  explicit Quant(const Q8Map& m)
      : map(&m), a(_mm512_loadu_ps(m.a)), c(_mm512_loadu_ps(m.c)), jhi(_mm512_loadu_ps(m.jhi)),
        unsure(_mm512_set1_ps(m.unsure)), region0(_mm512_loadu_si512(m.region)), region1(_mm512_loadu_si512(m.region + 16)),
        bound0(_mm512_loadu_si512(m.boundary)), bound1(_mm512_loadu_si512(m.boundary + 16)),
        lowest(_mm512_set1_epi32(96)), highest(_mm512_set1_epi32(127)), one(_mm512_set1_epi32(1)),
        zero(_mm512_set1_epi32(int(m.zero))), add0(_mm512_loadu_si512(m.region_add)),
        add1(_mm512_loadu_si512(m.region_add + 16)), bottom(_mm512_set1_epi32(96 << 23)) {}
};
template <bool Signed>
MFA_Q8_HOT __m512i q8_counts(const Quant<Signed>& q, __m512i z, __mmask16& unsure) {
  // Clamped to 96..127, whose low 5 bits (all that permutex2var reads) are the binade index.
  const __m512i e = _mm512_min_epu32(_mm512_max_epu32(_mm512_srli_epi32(z, 23), q.lowest), q.highest);
  __m512i r = _mm512_permutex2var_epi32(q.region0, e, q.region1);
  r = _mm512_mask_add_epi32(r, _mm512_cmpgt_epu32_mask(z, _mm512_permutex2var_epi32(q.bound0, e, q.bound1)), r, q.one);
  const __m512 f = _mm512_sub_ps(_mm512_mul_ps(_mm512_castsi512_ps(z), _mm512_permutexvar_ps(r, q.a)),
                                 _mm512_permutexvar_ps(r, q.c));
#if defined(__AVX512DQ__)
  const __m512 near = _mm512_reduce_ps(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // f - rint(f)
#else
  const __m512 near = _mm512_sub_ps(f, _mm512_roundscale_ps(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  unsure = _mm512_cmp_ps_mask(_mm512_abs_ps(near), q.unsure, _CMP_LE_OQ);  // false for NaN
  // min returns its second operand for a NaN estimate (z = inf in region 8): that region's count.
  return _mm512_cvttps_epi32(_mm512_min_ps(f, _mm512_permutexvar_ps(r, q.jhi)));
}
#if defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// The block's fast path: codes of 64 values, each finite with |x| < 1.5 (the step's x = m / absmax
// of a block whose scale and its inverse are finite): no NaN, infinity or binade above [1, 2), so
// the binade needs no upper clamp, the region is one addition (Q8Map::region_add), the signed
// map's negative lanes take |x| + 1 ulp in one masked addition, and the codes are packed and signed
// as bytes, 64 at a time: two byte permutes and a blend instead of four narrowing stores, and the
// zero code plus or minus the count with byte saturation (127 - 128 stays 0). The lanes too close
// to an integer are found for all 64 at once, from the smallest |f - rint(f)| (one vrangeps per
// 16 lanes); if there is one, the general search redoes those 64. The same counts as q8_counts.
constexpr bool kFastQuantize = true;
template <bool Signed>
MFA_Q8_HOT __m512i q8_counts_unit(const Quant<Signed>& q, __m512i z, __m512& nearest) {
  const __m512i zc = _mm512_max_epu32(z, q.bottom);  // below 2^-31: region 0, as binade 0's bottom
  const __m512i t = _mm512_permutex2var_epi32(q.add0, _mm512_srli_epi32(zc, 23), q.add1);
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(zc, t), 23);
  const __m512 f = _mm512_sub_ps(_mm512_mul_ps(_mm512_castsi512_ps(z), _mm512_permutexvar_ps(r, q.a)),
                                 _mm512_permutexvar_ps(r, q.c));
  const __m512 near = _mm512_reduce_ps(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // f - rint(f)
  nearest = _mm512_range_ps(near, nearest, 0x0A);  // min(|near|, |nearest|), its sign cleared
  return _mm512_cvttps_epi32(_mm512_min_ps(f, _mm512_permutexvar_ps(r, q.jhi)));
}
// The low bytes of four vectors of 32-bit lanes, in order, as one vector of 64 bytes.
MFA_Q8_HOT __m512i pack_low_bytes(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i idx = _mm512_set_epi8(
      124, 120, 116, 112, 108, 104, 100, 96, 92, 88, 84, 80, 76, 72, 68, 64, 60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20,
      16, 12, 8, 4, 0, 124, 120, 116, 112, 108, 104, 100, 96, 92, 88, 84, 80, 76, 72, 68, 64, 60, 56, 52, 48, 44, 40,
      36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
  return _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, _mm512_permutex2var_epi8(a, idx, b),
                                _mm512_permutex2var_epi8(c, idx, d));
}
template <bool Signed>
MFA_Q8_HOT void quantize(uint8_t* out, F x, const Quant<Signed>& q, bool positive_floor);
// Codes of x[0..64) * scale into out[0..64), every product finite with magnitude below 1.5.
template <bool Signed>
MFA_Q8_HOT void quantize64_unit(uint8_t* out, const float* x, F scale, const Quant<Signed>& q, bool positive_floor) {
  __m512i p[4];
  __m512 nearest = _mm512_set1_ps(1.0f);
  __mmask64 neg = 0;
  for (int k = 0; k < 4; ++k) {
    const __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * k), scale));
    if (Signed) {
      // The sign bits (-0 too: its count is that of 1 ulp, 0); 0x80000001 + u there is |x| + 1 ulp.
      const __mmask16 n = _mm512_movepi32_mask(u);
      neg |= __mmask64(n) << (16 * k);
      p[k] = q8_counts_unit(q, _mm512_mask_add_epi32(u, n, u, _mm512_set1_epi32(int(0x80000001u))), nearest);
    } else {
      // Below zero and at zero: code 0 (a negative lane's count, from its bits as they are, is
      // discarded); above zero the count (at least 1 with the floor).
      const __mmask16 keep = _mm512_cmpgt_epi32_mask(u, _mm512_setzero_si512());  // x > 0, as bits
      const __m512i c = q8_counts_unit(q, u, nearest);
      p[k] = positive_floor ? _mm512_maskz_max_epu32(keep, c, q.one) : _mm512_maskz_mov_epi32(keep, c);
    }
  }
  if (__builtin_expect(_mm512_cmp_ps_mask(nearest, q.unsure, _CMP_LE_OQ) != 0, 0)) {
    for (int k = 0; k < 4; ++k)
      quantize(out + 16 * k, _mm512_mul_ps(_mm512_loadu_ps(x + 16 * k), scale), q, positive_floor);
    return;
  }
  __m512i codes = pack_low_bytes(p[0], p[1], p[2], p[3]);
  if (Signed) {
    // The count is at most N + 1 = 128: 127 + count fits a byte; 127 - count saturates at 0.
    // (The floor changes nothing here: a positive x's code is at least 127.)
    const __m512i z8 = _mm512_set1_epi8(char(q.map->zero));
    codes = _mm512_mask_subs_epu8(_mm512_add_epi8(z8, codes), neg, z8, codes);
  }
  _mm512_storeu_si512(out, codes);
}
#else
constexpr bool kFastQuantize = false;
template <bool Signed>
inline void quantize64_unit(uint8_t*, const float*, F, const Quant<Signed>&, bool) {}
#endif
template <bool Signed>
MFA_Q8_HOT void quantize(uint8_t* out, F x, const Quant<Signed>& q, bool positive_floor) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i y = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  __mmask16 unsure, keep;  // the lanes whose code may be non-zero
  __m512i c;
  if (Signed) {
    const __mmask16 neg = _mm512_cmplt_epi32_mask(u, _mm512_setzero_si512());
    const __m512i p = q8_counts(q, _mm512_mask_add_epi32(y, neg, y, q.one), unsure);
    c = _mm512_mask_sub_epi32(_mm512_add_epi32(q.zero, p), neg, q.zero, _mm512_min_epu32(p, q.zero));
    if (positive_floor) c = _mm512_mask_max_epu32(c, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ), c, q.one);
    keep = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);  // NaN -> 0
  } else {
    // Below zero, at zero and NaN: code 0; above zero the count (at least 1 with the floor).
    keep = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
    c = q8_counts(q, y, unsure);
    if (positive_floor) c = _mm512_max_epu32(c, q.one);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_maskz_cvtepi32_epi8(keep, c));
  if (__builtin_expect(unsure != 0, 0)) {
    alignas(64) float t[W];
    _mm512_store_ps(t, x);
    recheck(out, t, unsure, *q.map, positive_floor);
  }
}
#elif defined(MFA_ISA_AVX2)
constexpr bool kFastQuantize = false;  // (AVX-512 with VBMI only)
template <bool Signed> struct Quant;
template <bool Signed>
inline void quantize64_unit(uint8_t*, const float*, Vec::F, const Quant<Signed>&, bool) {}
using Acc = __m256i;
inline Acc acc_zero() { return _mm256_setzero_si256(); }
constexpr bool kBlockDequant = false;  // the per-vector gather or lane loop
inline void dequant_block(const uint8_t*, const Q8Map&, float, float*) {}
inline F dequant(const uint8_t* c, const float* values, F scale) {
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
  return _mm256_mul_ps(_mm256_i32gather_ps(values, idx, 4), scale);
}
inline Acc acc_max(Acc a, F x) {
  return _mm256_max_epu32(a, _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF)));
}
inline uint32_t acc_reduce(Acc a) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
  return uint32_t(_mm_cvtsi128_si32(m));
}
inline F clamp(F u, F lo, F hi) { return _mm256_max_ps(lo, _mm256_min_ps(hi, u)); }
// The AVX-512 path's search (see there) on 8 lanes: the region by comparisons with the eight
// boundaries (no 32-entry permute here), regions 0..7's constants by permutes, region 8 by blend.
template <bool Signed>
struct Quant {
  const Q8Map* map;
  __m256 a, c, jhi, unsure;
  __m256i bound[8], top, one, zero;
  explicit Quant(const Q8Map& m)
      : map(&m), a(_mm256_loadu_ps(m.a)), c(_mm256_loadu_ps(m.c)), jhi(_mm256_loadu_ps(m.jhi)),
        unsure(_mm256_set1_ps(m.unsure)), top(_mm256_set1_epi32(int(m.jhi[8]))), one(_mm256_set1_epi32(1)),
        zero(_mm256_set1_epi32(int(m.zero))) {
    for (int k = 0; k < 8; ++k) bound[k] = _mm256_set1_epi32(int(m.boundaries[k]));
  }
};
// z as signed 32-bit integers: every boundary and every z but one NaN pattern are positive.
template <bool Signed>
MFA_Q8_HOT __m256i q8_counts(const Quant<Signed>& q, __m256i z, int& unsure) {
  __m256i r = _mm256_setzero_si256();
  for (int k = 0; k < 7; ++k) r = _mm256_sub_epi32(r, _mm256_cmpgt_epi32(z, q.bound[k]));  // a true mask is -1
  const __m256i above = _mm256_cmpgt_epi32(z, q.bound[7]);
  const __m256 f = _mm256_sub_ps(_mm256_mul_ps(_mm256_castsi256_ps(z), _mm256_permutevar8x32_ps(q.a, r)),
                                 _mm256_permutevar8x32_ps(q.c, r));
  const __m256 near = _mm256_sub_ps(f, _mm256_round_ps(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256 abs_near = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), near);
  unsure = _mm256_movemask_ps(_mm256_andnot_ps(_mm256_castsi256_ps(above), _mm256_cmp_ps(abs_near, q.unsure, _CMP_LE_OQ)));
  const __m256i p = _mm256_cvttps_epi32(_mm256_min_ps(f, _mm256_permutevar8x32_ps(q.jhi, r)));
  return _mm256_blendv_epi8(p, q.top, above);
}
template <bool Signed>
MFA_Q8_HOT void quantize(uint8_t* out, F x, const Quant<Signed>& q, bool positive_floor) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i y = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
  int unsure;
  __m256i c;
  if (Signed) {
    const __m256i neg = _mm256_srai_epi32(u, 31);
    const __m256i p = q8_counts(q, _mm256_sub_epi32(y, neg), unsure);
    c = _mm256_blendv_epi8(_mm256_add_epi32(q.zero, p), _mm256_sub_epi32(q.zero, _mm256_min_epu32(p, q.zero)), neg);
    if (positive_floor) {
      const __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
      c = _mm256_max_epu32(c, _mm256_and_si256(pos, q.one));
    }
    c = _mm256_and_si256(c, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q)));  // NaN -> 0
  } else {
    // Below zero, at zero and NaN: code 0; above zero the count (at least 1 with the floor).
    const __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
    c = q8_counts(q, y, unsure);
    if (positive_floor) c = _mm256_max_epu32(c, q.one);
    c = _mm256_and_si256(c, pos);
  }
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(w, w));
  if (__builtin_expect(unsure != 0, 0)) {
    alignas(32) float t[W];
    _mm256_store_ps(t, x);
    recheck(out, t, unsigned(unsure), *q.map, positive_floor);
  }
}
#else
// Scalar and NEON: the same operations one lane at a time (NEON has no gather); the search
// vectorized on NEON.
constexpr bool kFastQuantize = false;
template <bool Signed> struct Quant;
template <bool Signed>
inline void quantize64_unit(uint8_t*, const float*, Vec::F, const Quant<Signed>&, bool) {}
struct Acc { uint32_t lane[W]; };
inline Acc acc_zero() { return Acc{}; }
constexpr bool kBlockDequant = false;  // the per-vector gather or lane loop
inline void dequant_block(const uint8_t*, const Q8Map&, float, float*) {}
inline uint32_t bits_of(float x) { uint32_t u; __builtin_memcpy(&u, &x, 4); return u; }
inline F dequant(const uint8_t* c, const float* values, F scale) {
  float t[W];
  for (int k = 0; k < W; ++k) t[k] = values[c[k]];
  return Vec::load(t) * scale;
}
inline Acc acc_max(Acc a, F x) {
  float t[W];
  Vec::store(t, x);
  for (int k = 0; k < W; ++k) {
    const uint32_t b = bits_of(t[k]) & 0x7FFFFFFFu;
    a.lane[k] = b > a.lane[k] ? b : a.lane[k];
  }
  return a;
}
inline uint32_t acc_reduce(const Acc& a) {
  uint32_t m = 0;
  for (int k = 0; k < W; ++k) m = a.lane[k] > m ? a.lane[k] : m;
  return m;
}
inline F clamp(F u, F lo, F hi) {
  float t[W], l[W], h[W];
  Vec::store(t, u);
  Vec::store(l, lo);
  Vec::store(h, hi);
  for (int k = 0; k < W; ++k) {
    if (t[k] > h[k]) t[k] = h[k];
    if (t[k] < l[k]) t[k] = l[k];
  }
  return Vec::load(t);
}
#if defined(MFA_ISA_NEON)
// The AVX2 path's search on 4 lanes: the region by comparisons with the eight boundaries,
// regions 0..7's constants by byte table lookups (tbl), region 8 by select.
template <bool Signed>
struct Quant {
  const Q8Map* map;
  uint8x16x2_t a, c, jhi;  // regions 0..7's constants as 32 table bytes each
  uint32x4_t bound[8], top, zero;
  float32x4_t unsure;
  static uint8x16x2_t bytes8(const float* t) {
    return uint8x16x2_t{{vreinterpretq_u8_f32(vld1q_f32(t)), vreinterpretq_u8_f32(vld1q_f32(t + 4))}};
  }
  explicit Quant(const Q8Map& m)
      : map(&m), a(bytes8(m.a)), c(bytes8(m.c)), jhi(bytes8(m.jhi)), top(vdupq_n_u32(uint32_t(m.jhi[8]))),
        zero(vdupq_n_u32(m.zero)), unsure(vdupq_n_f32(m.unsure)) {
    for (int k = 0; k < 8; ++k) bound[k] = vdupq_n_u32(m.boundaries[k]);
  }
};
template <bool Signed>
inline uint32x4_t q8_counts(const Quant<Signed>& q, uint32x4_t z, bool& unsure) {
  uint32x4_t r = vdupq_n_u32(0);
  for (int k = 0; k < 7; ++k) r = vsubq_u32(r, vcgtq_u32(z, q.bound[k]));  // a true mask is -1
  const uint32x4_t above = vcgtq_u32(z, q.bound[7]);
  // Byte indices 4r..4r+3 of each lane's constant.
  const uint8x16_t idx = vreinterpretq_u8_u32(vaddq_u32(vmulq_n_u32(r, 0x04040404u), vdupq_n_u32(0x03020100u)));
  const float32x4_t a = vreinterpretq_f32_u8(vqtbl2q_u8(q.a, idx)), c = vreinterpretq_f32_u8(vqtbl2q_u8(q.c, idx));
  const float32x4_t hi = vreinterpretq_f32_u8(vqtbl2q_u8(q.jhi, idx));
  const float32x4_t f = vsubq_f32(vmulq_f32(vreinterpretq_f32_u32(z), a), c);
  const uint32x4_t near = vcleq_f32(vabsq_f32(vsubq_f32(f, vrndnq_f32(f))), q.unsure);  // false for NaN
  unsure = vmaxvq_u32(vbicq_u32(near, above)) != 0;
  // f below the region's top count, else (and for a NaN estimate) that count.
  const uint32x4_t p = vcvtq_u32_f32(vbslq_f32(vcltq_f32(f, hi), f, hi));
  return vbslq_u32(above, q.top, p);
}
template <bool Signed>
inline void quantize(uint8_t* out, F x, const Quant<Signed>& q, bool positive_floor) {
  const uint32x4_t u = vreinterpretq_u32_f32(x), one = vdupq_n_u32(1);
  const uint32x4_t y = vandq_u32(u, vdupq_n_u32(0x7FFFFFFFu));
  const uint32x4_t neg = vcltq_s32(vreinterpretq_s32_u32(u), vdupq_n_s32(0));
  const uint32x4_t pos = vcgtq_f32(x, vdupq_n_f32(0.0f));
  bool unsure;
  uint32x4_t c;
  if (Signed) {
    const uint32x4_t p = q8_counts(q, vsubq_u32(y, neg), unsure);
    c = vbslq_u32(neg, vsubq_u32(q.zero, vminq_u32(p, q.zero)), vaddq_u32(q.zero, p));
    if (positive_floor) c = vbslq_u32(pos, vmaxq_u32(c, one), c);
    c = vandq_u32(c, vceqq_f32(x, x));  // NaN -> 0
  } else {
    // Below zero, at zero and NaN: code 0; above zero the count (at least 1 with the floor).
    c = q8_counts(q, y, unsure);
    if (positive_floor) c = vmaxq_u32(c, one);
    c = vandq_u32(c, pos);
  }
  const uint8x8_t b = vmovn_u16(vcombine_u16(vmovn_u32(c), vmovn_u32(c)));
  vst1_lane_u32(reinterpret_cast<uint32_t*>(out), vreinterpret_u32_u8(b), 0);
  if (unsure) {
    float t[W];
    vst1q_f32(t, x);
    recheck(out, t, 0xFu, *q.map, positive_floor);
  }
}
#else
// One lane at a time: q8_search.h's definition itself.
template <bool Signed>
struct Quant {
  const Q8Map* map;
  explicit Quant(const Q8Map& m) : map(&m) {}
};
template <bool Signed>
inline void quantize(uint8_t* out, F x, const Quant<Signed>& q, bool positive_floor) {
  float t[W];
  Vec::store(t, x);
  for (int k = 0; k < W; ++k) out[k] = q8_code(t[k], *q.map, positive_floor);
}
#endif  // MFA_ISA_NEON
#endif

inline float from_bits(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }

// Blocks [b0, b1): the 8-bit step of lowbit.py, one block after another.
template <class PS>
void adam8bit_blocks(const Q8Job& job, int64_t b0, int64_t b1) {
  using P = typename ParamStorage<PS>::T;
  const Adam8bitScalars& s = job.s;
  const AdamRule adam(s);  // rules.h: the Adam element math, here with the 8-bit rule's clamp
  const F clip = Vec::set1(s.clip), nclip = Vec::set1(-s.clip);
  // Locals, not job fields: byte stores may alias anything, so fields would be reloaded.
  P* const param = static_cast<P*>(job.param);
  const P* const grad = static_cast<const P*>(job.grad);
  uint8_t* const codes1 = job.codes1;
  uint8_t* const codes2 = job.codes2;
  float* const absmax1 = job.absmax1;
  float* const absmax2 = job.absmax2;
  const Q8Map map1 = job.map1, map2 = job.map2;
  const Quant<true> quant1(map1);  // the first moment's map is signed, the second's not (adam8bit.cpp checks)
  const Quant<false> quant2(map2);
  const int64_t n = job.n;
  const uint32_t sr_key = job.sr_key;
  alignas(64) float mb[kQ8Block], vb[kQ8Block];
  const bool block_dequant = kBlockDequant && q8_permute_dequant();
  // One vector: dequantize, Adam v2 with the clamp, store the param; m and v come back.
  auto update = [&](P* pp, const P* gp, const uint8_t* c1, const uint8_t* c2, int64_t index, F a1, F a2, F& m,
                    F& v) {
    F p = Vec::load(pp), g = Vec::load(gp);
    if (block_dequant) {  // dequantized already: mb/vb at this vector's offset in the block
      m = Vec::load(mb + (index & (kQ8Block - 1)));
      v = Vec::load(vb + (index & (kQ8Block - 1)));
    } else {
      m = dequant(c1, map1.values, a1);
      v = dequant(c2, map2.values, a2);
    }
    adam.step(p, g, m, v, [&](F u) { return clamp(u, nclip, clip); });
    ParamStorage<PS>::store(pp, p, sr_key, index);
  };
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * kQ8Block;
    const int len = int(n - lo < kQ8Block ? n - lo : kQ8Block);
    const F a1 = Vec::set1(absmax1[b]), a2 = Vec::set1(absmax2[b]);
    if (block_dequant) {
      if (len == kQ8Block) {
        dequant_block(codes1 + lo, map1, absmax1[b], mb);
        dequant_block(codes2 + lo, map2, absmax2[b], vb);
      } else {
        alignas(64) uint8_t cb[kQ8Block] = {};  // the short last block, zero-padded
        __builtin_memcpy(cb, codes1 + lo, unsigned(len));
        dequant_block(cb, map1, absmax1[b], mb);
        __builtin_memcpy(cb, codes2 + lo, unsigned(len));
        dequant_block(cb, map2, absmax2[b], vb);
      }
    }
    Acc mx1 = acc_zero(), mx2 = acc_zero();
    int j = 0;
    for (; j + W <= len; j += W) {
      F m, v;
      update(param + lo + j, grad + lo + j, codes1 + lo + j, codes2 + lo + j, lo + j, a1, a2, m, v);
      Vec::store(mb + j, m);
      Vec::store(vb + j, v);
      mx1 = acc_max(mx1, m);
      mx2 = acc_max(mx2, v);
    }
    const int r = len - j;
    if (r > 0) {
      // A short last vector goes through the same math on zero-padded copies; its pad lanes
      // are zeroed before they could reach the absmax.
      P pb[W] = {}, gb[W] = {};
      uint8_t cb1[W] = {}, cb2[W] = {};
      for (int k = 0; k < r; ++k) {
        pb[k] = param[lo + j + k];
        gb[k] = grad[lo + j + k];
        cb1[k] = codes1[lo + j + k];
        cb2[k] = codes2[lo + j + k];
      }
      F m, v;
      update(pb, gb, cb1, cb2, lo + j, a1, a2, m, v);
      for (int k = 0; k < r; ++k) param[lo + j + k] = pb[k];
      Vec::store(mb + j, m);
      Vec::store(vb + j, v);
      for (int k = r; k < W; ++k) mb[j + k] = vb[j + k] = 0.0f;
      mx1 = acc_max(mx1, Vec::load(mb + j));
      mx2 = acc_max(mx2, Vec::load(vb + j));
    }
    // The absmax as the reference's amax of |x|: non-negative floats order as their bit
    // patterns, and any NaN pattern lies above +inf's, so a NaN anywhere makes the scale NaN.
    const float s1 = from_bits(acc_reduce(mx1)), s2 = from_bits(acc_reduce(mx2));
    const float i1 = s1 == 0.0f ? 0.0f : 1.0f / s1, i2 = s2 == 0.0f ? 0.0f : 1.0f / s2;
    const F inv1 = Vec::set1(i1), inv2 = Vec::set1(i2);
    // A finite scale with a finite inverse makes every x = m * inverse finite, |x| <= 1 + 2 ulps:
    // the fast path's condition (whole blocks; the others take the general search).
    const bool fast1 = kFastQuantize && len == kQ8Block && __builtin_isfinite(s1) && __builtin_isfinite(i1);
    const bool fast2 = kFastQuantize && len == kQ8Block && __builtin_isfinite(s2) && __builtin_isfinite(i2);
    if (fast1 && fast2) {
      for (j = 0; j < kQ8Block; j += 64) {
        quantize64_unit(codes1 + lo + j, mb + j, inv1, quant1, false);
        quantize64_unit(codes2 + lo + j, vb + j, inv2, quant2, true);
      }
    } else {
      for (j = 0; j + W <= len; j += W) {
        quantize(codes1 + lo + j, Vec::load(mb + j) * inv1, quant1, false);
        quantize(codes2 + lo + j, Vec::load(vb + j) * inv2, quant2, true);
      }
    }
    if (r > 0) {
      uint8_t q1[W], q2[W];
      quantize(q1, Vec::load(mb + j) * inv1, quant1, false);
      quantize(q2, Vec::load(vb + j) * inv2, quant2, true);
      for (int k = 0; k < r; ++k) {
        codes1[lo + j + k] = q1[k];
        codes2[lo + j + k] = q2[k];
      }
    }
    absmax1[b] = s1;
    absmax2[b] = s2;
  }
}

// The memory floor of the 8-bit step (bench): per block, the same bytes read and written
// (param, grad, both code arrays, both scales) with trivial math that keeps every value (x + g * 0,
// codes + 0; the zeros come from the scalars, so nothing is dropped), so the benchmark can run it
// on the optimizer's own tensors (see FloorRule in rules.h).
template <class PS>
void adam8bit_floor_blocks(const Q8Job& job, int64_t b0, int64_t b1) {
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
    const int64_t lo = b * kQ8Block;
    const int64_t hi = n - lo < kQ8Block ? n : lo + kQ8Block;
    int64_t i = lo;
    for (; i + W <= hi; i += W) Vec::store(param + i, Vec::load(param + i) + Vec::load(grad + i) * zv);
    if (i < hi) {  // the short last vector, through zero-padded copies as in the step
      P pb[W] = {}, gb[W] = {};
      const int64_t r = hi - i;
      for (int64_t k = 0; k < r; ++k) {
        pb[k] = param[i + k];
        gb[k] = grad[i + k];
      }
      Vec::store(pb, Vec::load(pb) + Vec::load(gb) * zv);
      for (int64_t k = 0; k < r; ++k) param[i + k] = pb[k];
    }
    for (i = lo; i < hi; ++i) codes1[i] = uint8_t(codes1[i] + zc);
    for (i = lo; i < hi; ++i) codes2[i] = uint8_t(codes2[i] + zc);
    absmax1[b] = absmax1[b] + zero;
    absmax2[b] = absmax2[b] + zero;
  }
}

template <bool Signed>
void quantize_map(const float* x, int64_t n, const Q8Map& map, bool positive_floor, uint8_t* out) {
  const Quant<Signed> q(map);
  int64_t i = 0;
  if (kFastQuantize) {
    // 64 values at a time through the step's fast path where they meet its condition (so the
    // tests hold both searches to the reference), else the general one.
    for (; i + 64 <= n; i += 64) {
      bool unit = true;
      for (int k = 0; k < 64; ++k) unit = unit && __builtin_fabsf(x[i + k]) < 1.5f;  // false for NaN
      if (unit) {
        quantize64_unit(out + i, x + i, Vec::set1(1.0f), q, positive_floor);
      } else {
        for (int k = 0; k < 64; k += W) quantize(out + i + k, Vec::load(x + i + k), q, positive_floor);
      }
    }
  }
  for (; i + W <= n; i += W) quantize(out + i, Vec::load(x + i), q, positive_floor);
  if (i < n) {
    float t[W] = {};
    uint8_t c[W];
    for (int64_t k = 0; k < n - i; ++k) t[k] = x[i + k];
    quantize(c, Vec::load(t), q, positive_floor);
    for (int64_t k = 0; k < n - i; ++k) out[i + k] = c[k];
  }
}
inline void quantize_n(const float* x, int64_t n, const Q8Map& map, bool positive_floor, uint8_t* out) {
  (map.is_signed ? quantize_map<true> : quantize_map<false>)(x, n, map, positive_floor, out);
}

}  // namespace q8

inline void fill_adam8bit(IsaTable& t) {
  t.q8_quantize = q8::quantize_n;
  t.adam8bit[int(Q8Param::F32)] = q8::adam8bit_blocks<float>;
  t.adam8bit[int(Q8Param::F16)] = q8::adam8bit_blocks<mfa::f16>;
  t.adam8bit[int(Q8Param::BF16)] = q8::adam8bit_blocks<mfa::bf16>;
  t.adam8bit[int(Q8Param::BF16SR)] = q8::adam8bit_blocks<mfa::bf16sr>;
  t.adam8bit_floor[int(Q8Param::F32)] = q8::adam8bit_floor_blocks<float>;
  t.adam8bit_floor[int(Q8Param::F16)] = q8::adam8bit_floor_blocks<mfa::f16>;
  t.adam8bit_floor[int(Q8Param::BF16)] = q8::adam8bit_floor_blocks<mfa::bf16>;
  t.adam8bit_floor[int(Q8Param::BF16SR)] = q8::adam8bit_floor_blocks<mfa::bf16>;
}
