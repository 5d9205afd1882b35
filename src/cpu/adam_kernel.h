// The CPU kernel's span loop, generic over the update rule, instantiated per ISA from the rule
// list (adam_types.h MFA_RULES) and the dtype pairs. Included by each adam_<isa>.cpp after it has
// defined `Vec` for its ISA, inside a namespace of its own, so templates built with different -m
// flags never merge at link time.
#pragma once

#include "rules.h"

// Param storage: P is the storage type, except bf16sr, which is bf16 in memory and stores by
// stochastic rounding (lowbit.py). The random bits come from a plain loop over the W lanes that
// the compiler vectorizes for each ISA's flags; the result does not depend on the ISA.
template <class P> struct ParamStorage {
  using T = P;
  static inline void store(T* dst, typename Vec::F x, uint32_t, int64_t) { Vec::store(dst, x); }
};
template <> struct ParamStorage<bf16sr> {
  using T = bf16;
#if defined(MFA_ISA_AVX512)
  // AVX-512: the same hash on 16 lanes in zmm registers (GCC's auto-vectorizer stops at 256 bits).
  static inline void store(T* dst, __m512 x, uint32_t key, int64_t index) {
    const uint32_t lo0 = uint32_t(uint64_t(index)), hi0 = uint32_t(uint64_t(index) >> 32);
    __m512i h;
    if (lo0 <= 0xFFFFFFFFu - 15u) {
      // (lo0 + k) * C is lo0 * C + k * C modulo 2^32: one add per vector instead of a multiply,
      // and the high word is the same in every lane, so its product folds into the key.
      const __m512i kc = _mm512_setr_epi32(0, int(0x9E3779B9u), int(0x3C6EF372u), int(0xDAA66D2Bu), int(0x78DDE6E4u),
                                           int(0x1715609Du), int(0xB54CDA56u), int(0x5384540Fu), int(0xF1BBCDC8u),
                                           int(0x8FF34781u), int(0x2E2AC13Au), int(0xCC623AF3u), int(0x6A99B4ACu),
                                           int(0x08D12E65u), int(0xA708A81Eu), int(0x454021D7u));
      h = _mm512_xor_si512(_mm512_set1_epi32(int(key ^ (hi0 * 0x85EBCA77u))),
                           _mm512_add_epi32(_mm512_set1_epi32(int(lo0 * 0x9E3779B9u)), kc));
    } else {
      const __m512i lo = _mm512_add_epi32(_mm512_set1_epi32(int(lo0)),
                                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      // Lanes whose low word wrapped past 2^32 belong to the next high word.
      const __mmask16 wrap = _mm512_cmplt_epu32_mask(lo, _mm512_set1_epi32(int(lo0)));
      const __m512i hi = _mm512_mask_add_epi32(_mm512_set1_epi32(int(hi0)), wrap, _mm512_set1_epi32(int(hi0)),
                                               _mm512_set1_epi32(1));
      h = _mm512_xor_si512(_mm512_set1_epi32(int(key)),
                           _mm512_xor_si512(_mm512_mullo_epi32(lo, _mm512_set1_epi32(int(0x9E3779B9u))),
                                            _mm512_mullo_epi32(hi, _mm512_set1_epi32(int(0x85EBCA77u)))));
    }
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(int(0x85EBCA6Bu)));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(int(0xC2B2AE35u)));
    // fmix32's last step, h ^= h >> 16, leaves the top 16 bits (the random bits) unchanged.
    __m512i r = _mm512_add_epi32(_mm512_castps_si512(x), _mm512_srli_epi32(h, 16));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
#if defined(__AVX512BW__)
    // The high halves of the 16 words in one permute (vpermw) instead of a shift and a narrowing.
    const __m512i odd = _mm512_setr_epi32(0x00030001, 0x00070005, 0x000B0009, 0x000F000D, 0x00130011, 0x00170015,
                                          0x001B0019, 0x001F001D, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_castsi512_si256(_mm512_permutexvar_epi16(odd, r)));
#else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
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
    for (int k = 0; k < W; ++k) {
      const uint64_t ix = uint64_t(index) + uint64_t(k);
      uint32_t h = key ^ (uint32_t(ix) * 0x9E3779B9u) ^ (uint32_t(ix >> 32) * 0x85EBCA77u);
      h ^= h >> 16;
      h *= 0x85EBCA6Bu;
      h ^= h >> 13;
      h *= 0xC2B2AE35u;
      h ^= h >> 16;
      const uint32_t rounded = (u[k] + (h >> 16)) >> 16;
      out[k] = uint16_t((u[k] & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
    }
    __builtin_memcpy(dst, out, sizeof out);
  }
#endif
};

// Vectors per loop iteration: a build-time knob for tuning; 2 is the measured choice (16-core
// Xeon, AVX-512: unrolling 4 vectors was no better). The prefetch distance is chosen at run time
// per CPU vendor and dtypes (prefetch_bytes(), adam_types.h).
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
  // U independent vectors per iteration: the divide/sqrt chain of one hides the others' latency.
  constexpr int U = MFA_UNROLL;
  for (; i + U * W <= end; i += U * W) {
    if (prefetch > 0) {
      for (int u = 0; u < U; ++u) {
        __builtin_prefetch(p + i + u * W + ahead_p, 1);
        __builtin_prefetch(g + i + u * W + ahead_p, 0);
        for (int k = 0; k < K; ++k) __builtin_prefetch(st[k] + i + u * W + ahead_s, 1);
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

inline IsaTable make_table(const char* name) {
  IsaTable t{};
  t.name = name;
  fill_adam8bit(t);
#define MFA_FILL_ROW(id, rname, functor, scalars, states)                                       \
  static_assert(functor::kStates == (states) && (states) <= kMaxStates, "state count of " rname); \
  static_assert(std::is_same<functor::Scalars, scalars>::value, "scalar struct of " rname);      \
  fill_row<functor>(t.fn[int(RuleId::id)]);
  MFA_RULES(MFA_FILL_ROW)
#undef MFA_FILL_ROW
  return t;
}
