// The CPU kernel's span loop, generic over the update rule, instantiated per ISA from the rule
// list (adam_types.h MFA_RULES) and the dtype pairs. Included by each adam_<isa>.cpp after it has
// defined `Vec` for its ISA, inside a namespace of its own, so templates built with different -m
// flags never merge at link time.
#pragma once

#include "rules.h"

// Param storage: P is the storage type, except bf16sr, which is bf16 in memory and stores by
// stochastic rounding (lowbit.py). The random bits come from a plain loop over the W lanes that
// the compiler vectorizes for each ISA's flags; the result does not depend on the ISA.
// store_pair is the inverse of Vec::load_pair (the bf16 pair path of span_kernel below).
template <class P> struct ParamStorage {
  using T = P;
  static inline void store(T* dst, typename Vec::F x, uint32_t, int64_t) { Vec::store(dst, x); }
  template <class V = Vec>  // V: looked up only where the pair path is built
  static inline void store_pair(T* dst, typename V::F even, typename V::F odd, uint32_t, int64_t) {
    V::store_pair(dst, even, odd);
  }
};
// lowbit.py's hash of one element index under a key: the top 16 bits are the random bits that
// round one value stochastically (the lane loops below; the AVX-512 code computes the same).
inline uint32_t sr_hash(uint32_t key, uint64_t ix) {
  uint32_t h = key ^ (uint32_t(ix) * 0x9E3779B9u) ^ (uint32_t(ix >> 32) * 0x85EBCA77u);
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}
// The bf16 bits of fp32 bits u rounded up with probability proportional to the distance (the
// random bits are added below the kept ones); any NaN becomes torch's 0x7FC0.
inline uint16_t sr_round(uint32_t u, uint32_t h) {
  return uint16_t((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : (u + (h >> 16)) >> 16);
}
template <> struct ParamStorage<bf16sr> {
  using T = bf16;
#if defined(MFA_ISA_AVX512)
  // AVX-512: the same hash on 16 lanes in zmm registers (GCC's auto-vectorizer stops at 256 bits),
  // for the element indices first + stride * lane, lane 0 to 15, stride 1 or 2; fmix32's last
  // step, h ^= h >> 16, is left out: it leaves the top 16 bits (the random bits) unchanged.
  // stride * k * 0x9E3779B9 modulo 2^32 in lane k (stride 1 or 2): the lanes' index products.
  static inline __m512i lane_products(int stride) {
    const __m512i kc = _mm512_setr_epi32(0, int(0x9E3779B9u), int(0x3C6EF372u), int(0xDAA66D2Bu), int(0x78DDE6E4u),
                                         int(0x1715609Du), int(0xB54CDA56u), int(0x5384540Fu), int(0xF1BBCDC8u),
                                         int(0x8FF34781u), int(0x2E2AC13Au), int(0xCC623AF3u), int(0x6A99B4ACu),
                                         int(0x08D12E65u), int(0xA708A81Eu), int(0x454021D7u));
    return stride == 2 ? _mm512_add_epi32(kc, kc) : kc;
  }
  static inline __m512i hash(uint32_t key, int64_t first, int stride) {
    const uint32_t lo0 = uint32_t(uint64_t(first)), hi0 = uint32_t(uint64_t(first) >> 32);
    if (lo0 <= 0xFFFFFFFFu - 15u * uint32_t(stride)) {
      // (lo0 + k) * C is lo0 * C + k * C modulo 2^32: one add per vector instead of a multiply,
      // and the high word is the same in every lane, so its product folds into the key.
      return fmix_keyed(folded_key(key ^ (hi0 * 0x85EBCA77u)),
                        _mm512_add_epi32(_mm512_set1_epi32(int(lo0 * 0x9E3779B9u)), lane_products(stride)));
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i lo = _mm512_add_epi32(_mm512_set1_epi32(int(lo0)), _mm512_mullo_epi32(lane, _mm512_set1_epi32(stride)));
    // Lanes whose low word wrapped past 2^32 belong to the next high word.
    const __mmask16 wrap = _mm512_cmplt_epu32_mask(lo, _mm512_set1_epi32(int(lo0)));
    const __m512i hi = _mm512_mask_add_epi32(_mm512_set1_epi32(int(hi0)), wrap, _mm512_set1_epi32(int(hi0)),
                                             _mm512_set1_epi32(1));
    return fmix(_mm512_xor_si512(_mm512_set1_epi32(int(key)),
                                 _mm512_xor_si512(_mm512_mullo_epi32(lo, _mm512_set1_epi32(int(0x9E3779B9u))),
                                                  _mm512_mullo_epi32(hi, _mm512_set1_epi32(int(0x85EBCA77u))))));
  }
  // fmix32 without its last step, h ^= h >> 16, which leaves the top 16 bits unchanged.
  static inline __m512i fmix(__m512i h) { return fmix_rest(_mm512_xor_si512(h, _mm512_srli_epi32(h, 16))); }
  // fmix32 after its first step, h ^= h >> 16 (and without its last).
  static inline __m512i fmix_rest(__m512i h) {
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(int(0x85EBCA6Bu)));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
    return _mm512_mullo_epi32(h, _mm512_set1_epi32(int(0xC2B2AE35u)));
  }
  // fmix(k ^ b) for a key k that is the same in every lane, given folded_key(k): the shift
  // distributes over the xor, (k ^ b) ^ ((k ^ b) >> 16) = (k ^ k >> 16) ^ b ^ (b >> 16), so the
  // key's half is computed once per call and the rest is one three-way xor (vpternlogd). In the
  // bf16 Adam step at 1 thread, this and the masked add below took stochastic rounding from +24%
  // to +26% over round to nearest to +17% to +20% on the EPYC, from memory
  // (diag_sr_hash.cpp, docs/experiments.md, sr_hash_2core.txt).
  static inline __m512i folded_key(uint32_t k) { return _mm512_set1_epi32(int(k ^ (k >> 16))); }
  static inline __m512i fmix_keyed(__m512i folded, __m512i b) {
    return fmix_rest(_mm512_ternarylogic_epi32(folded, b, _mm512_srli_epi32(b, 16), 0x96));
  }
  // 32-bit words whose high halves are x's stochastically rounded bf16 bits (sr_round); NaN
  // lanes take 0x7FC00000 through the add's mask rather than a separate blend.
  static inline __m512i add_random(__m512 x, __m512i h) {
    return _mm512_mask_add_epi32(_mm512_set1_epi32(0x7FC00000), _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q),
                                 _mm512_castps_si512(x), _mm512_srli_epi32(h, 16));
  }
  static inline void store(T* dst, __m512 x, uint32_t key, int64_t index) {
    const __m512i r = add_random(x, hash(key, index, 1));
#if defined(__AVX512BW__)
    // The high halves of the 16 words in one permute (vpermw) instead of a shift and a narrowing.
    const __m512i odd = _mm512_setr_epi32(0x00030001, 0x00070005, 0x000B0009, 0x000F000D, 0x00130011, 0x00170015,
                                          0x001B0019, 0x001F001D, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_castsi512_si256(_mm512_permutexvar_epi16(odd, r)));
#else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
#endif
  }
  template <class V = Vec>
  static inline void store_pair(T* dst, __m512 even, __m512 odd, uint32_t key, int64_t index) {
    __m512i he, ho;
    const uint32_t lo0 = uint32_t(uint64_t(index));
    if (lo0 <= 0xFFFFFFFFu - 31u) {
      // Both vectors' index products from one broadcast: (lo0 + 2k + 1) * C = (lo0 + 2k) * C + C.
      const __m512i k = folded_key(key ^ (uint32_t(uint64_t(index) >> 32) * 0x85EBCA77u));
      const __m512i base = _mm512_add_epi32(_mm512_set1_epi32(int(lo0 * 0x9E3779B9u)), lane_products(2));
      he = fmix_keyed(k, base);
      ho = fmix_keyed(k, _mm512_add_epi32(base, _mm512_set1_epi32(int(0x9E3779B9u))));
    } else {
      he = hash(key, index, 2);
      ho = hash(key, index + 1, 2);
    }
    const __m512i re = _mm512_srli_epi32(add_random(even, he), 16);
    const __m512i ro = add_random(odd, ho);
    // Element 2k is even's lane k (the low half of word k), element 2k + 1 odd's (the high half).
#if defined(__AVX512BW__)
    _mm512_storeu_si512(dst, _mm512_mask_blend_epi16(0x55555555u, ro, re));
#else
    _mm512_storeu_si512(dst, _mm512_or_si512(_mm512_and_si512(ro, _mm512_set1_epi32(int(0xFFFF0000u))), re));
#endif
  }
#else
  static inline void store(T* dst, typename Vec::F x, uint32_t key, int64_t index) {
    constexpr int W = Vec::W;
    float tmp[W];
    uint32_t u[W];
    uint16_t out[W];
    Vec::store(tmp, x);
    __builtin_memcpy(u, tmp, sizeof u);
    // Whole-array copies and a branch-free lane loop: each ISA build vectorizes it.
    for (int k = 0; k < W; ++k) out[k] = sr_round(u[k], sr_hash(key, uint64_t(index) + uint64_t(k)));
    __builtin_memcpy(dst, out, sizeof out);
  }
  template <class V = Vec>
  static inline void store_pair(T* dst, typename V::F even, typename V::F odd, uint32_t key, int64_t index) {
    constexpr int W = V::W;
    float te[W], to[W];
    uint32_t ue[W], uo[W];
    uint16_t out[2 * W];
    V::store(te, even);
    V::store(to, odd);
    __builtin_memcpy(ue, te, sizeof ue);
    __builtin_memcpy(uo, to, sizeof uo);
    for (int k = 0; k < W; ++k) {
      out[2 * k] = sr_round(ue[k], sr_hash(key, uint64_t(index) + uint64_t(2 * k)));
      out[2 * k + 1] = sr_round(uo[k], sr_hash(key, uint64_t(index) + uint64_t(2 * k + 1)));
    }
    __builtin_memcpy(dst, out, sizeof out);
  }
#endif
};

// One iteration of the bf16 pair path: 2W elements of a rule whose params and states are all
// bf16, each stream loaded as its even and odd elements (Vec::load_pair). V is a template
// parameter so that ISAs without the pair functions never look them up.
template <class Rule, class PS, class V = Vec>
inline void pair_step(const Rule& rule, bf16* p, const bf16* g, bf16* const* st, int64_t i, uint32_t key) {
  constexpr int K = Rule::kStates;
  typename V::F pv[2], gv[2], sv[2][K];
  V::load_pair(p + i, pv[0], pv[1]);
  V::load_pair(g + i, gv[0], gv[1]);
  for (int k = 0; k < K; ++k) V::load_pair(st[k] + i, sv[0][k], sv[1][k]);
  rule(pv[0], gv[0], sv[0]);
  rule(pv[1], gv[1], sv[1]);
  ParamStorage<PS>::template store_pair<V>(p + i, pv[0], pv[1], key, i);
  for (int k = 0; k < K; ++k) V::store_pair(st[k] + i, sv[0][k], sv[1][k]);
}

// Vectors per loop iteration: a build-time knob for tuning; 2 is the measured choice (16-core
// Xeon, AVX-512: unrolling 4 vectors was no better; 2-core EPYC, fp32, in one run each: 4 vectors
// 1.00x and 0.99x at 1 and 2 threads, 8 vectors with the loads grouped by stream 0.64x and 0.88x,
// 2 vectors with the loads grouped by stream, as DeepSpeed's loop has them, 1.01x and 1.01x).
// The prefetch distances (near, and far into L2) are chosen at run time per CPU vendor and dtypes
// (prefetch_bytes(), far_prefetch_bytes(), adam_types.h).
#ifndef MFA_UNROLL
#define MFA_UNROLL 2
#endif

template <class Rule, class PS, class S>
void span_kernel(const Span& sp, int64_t begin, int64_t end, const void* scalars) {
  constexpr int W = Vec::W;
  constexpr int K = Rule::kStates;
  using F = typename Vec::F;
  using P = typename ParamStorage<PS>::T;
  const Rule rule(*static_cast<const typename Rule::Scalars*>(scalars));
  const uint32_t key = sp.sr_key;
  P* p = static_cast<P*>(sp.param);
  const P* g = static_cast<const P*>(sp.grad);
  S* st[K];
  for (int k = 0; k < K; ++k) st[k] = static_cast<S*>(sp.state[k]);
  int64_t i = begin;
  const int prefetch = prefetch_bytes(int(sizeof(P)), int(sizeof(S)));
  const int64_t ahead_p = prefetch / int(sizeof(P)), ahead_s = prefetch / int(sizeof(S));
  const int far = far_prefetch_bytes(int(sizeof(P)), int(sizeof(S)));
  const int64_t far_p = far / int(sizeof(P)), far_s = far / int(sizeof(S));
  // U independent vectors per iteration: the divide/sqrt chain of one hides the others' latency.
  constexpr int U = MFA_UNROLL;
  // bf16 params and states (and grads): 2W elements per iteration as even and odd lanes.
  constexpr bool kPairs = Vec::kBf16Pairs && U == 2 && std::is_same<P, bf16>::value && std::is_same<S, bf16>::value;
  const bool pairs = kPairs && bf16_pairs();
  for (; i + U * W <= end; i += U * W) {
    if (prefetch > 0) {
      for (int u = 0; u < U; ++u) {
        __builtin_prefetch(p + i + u * W + ahead_p, 1);
        __builtin_prefetch(g + i + u * W + ahead_p, 0);
        for (int k = 0; k < K; ++k) __builtin_prefetch(st[k] + i + u * W + ahead_s, 1);
      }
    }
    if (far > 0) {
      // Into L2 only: the near prefetch above then finds the line there.
      for (int u = 0; u < U; ++u) {
        __builtin_prefetch(p + i + u * W + far_p, 1, 1);
        __builtin_prefetch(g + i + u * W + far_p, 0, 1);
        for (int k = 0; k < K; ++k) __builtin_prefetch(st[k] + i + u * W + far_s, 1, 1);
      }
    }
    if constexpr (kPairs) {
      if (pairs) {
        pair_step<Rule, PS>(rule, p, g, st, i, key);
        continue;
      }
    }
    F pv[U], sv[U][K];
    for (int u = 0; u < U; ++u) {
      pv[u] = Vec::load(p + i + u * W);
      for (int k = 0; k < K; ++k) sv[u][k] = Vec::load(st[k] + i + u * W);
    }
    for (int u = 0; u < U; ++u) rule(pv[u], Vec::load(g + i + u * W), sv[u]);
    for (int u = 0; u < U; ++u) {
      ParamStorage<PS>::store(p + i + u * W, pv[u], key, i + u * W);
      for (int k = 0; k < K; ++k) Vec::store(st[k] + i + u * W, sv[u][k]);
    }
  }
  for (; i + W <= end; i += W) {
    F pv = Vec::load(p + i), sv[K];
    for (int k = 0; k < K; ++k) sv[k] = Vec::load(st[k] + i);
    rule(pv, Vec::load(g + i), sv);
    ParamStorage<PS>::store(p + i, pv, key, i);
    for (int k = 0; k < K; ++k) Vec::store(st[k] + i, sv[k]);
  }
  if (i < end) {
    // The tail goes through the same vector math on zero-padded copies, so every element of
    // every path sees the identical instruction sequence.
    const int64_t r = end - i;
    P pb[W] = {}, gb[W] = {};
    S sb[K][W] = {};
    for (int64_t j = 0; j < r; ++j) {
      pb[j] = p[i + j];
      gb[j] = g[i + j];
      for (int k = 0; k < K; ++k) sb[k][j] = st[k][i + j];
    }
    F pv = Vec::load(pb), sv[K];
    for (int k = 0; k < K; ++k) sv[k] = Vec::load(sb[k]);
    rule(pv, Vec::load(gb), sv);
    ParamStorage<PS>::store(pb, pv, key, i);  // pb[j] is element i + j
    for (int k = 0; k < K; ++k) Vec::store(sb[k], sv[k]);
    for (int64_t j = 0; j < r; ++j) {
      p[i + j] = pb[j];
      for (int k = 0; k < K; ++k) st[k][i + j] = sb[k][j];
    }
  }
}

template <class Rule>
inline void fill_row(SpanFn (&row)[static_cast<int>(Combo::Count)]) {
  row[int(Combo::F32_F32)] = span_kernel<Rule, float, float>;
  row[int(Combo::F16_F32)] = span_kernel<Rule, mfa::f16, float>;
  row[int(Combo::F16_F16)] = span_kernel<Rule, mfa::f16, mfa::f16>;
  row[int(Combo::BF16_F32)] = span_kernel<Rule, mfa::bf16, float>;
  row[int(Combo::BF16_BF16)] = span_kernel<Rule, mfa::bf16, mfa::bf16>;
  row[int(Combo::BF16SR_F32)] = span_kernel<Rule, mfa::bf16sr, float>;
  row[int(Combo::BF16SR_BF16)] = span_kernel<Rule, mfa::bf16sr, mfa::bf16>;
}

#include "adam8bit_kernel.h"
#include "adam4bit_kernel.h"

inline IsaTable make_table(const char* name) {
  IsaTable t{};
  t.name = name;
  fill_adam8bit(t);
  fill_adam4bit(t);
#define MFA_FILL_ROW(id, rname, functor, scalars, states)                                       \
  static_assert(functor::kStates == (states) && (states) <= kMaxStates, "state count of " rname); \
  static_assert(std::is_same<functor::Scalars, scalars>::value, "scalar struct of " rname);      \
  fill_row<functor>(t.fn[int(RuleId::id)]);
  MFA_RULES(MFA_FILL_ROW)
#undef MFA_FILL_ROW
  return t;
}
