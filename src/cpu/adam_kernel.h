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
  static inline void store(T* dst, typename Vec::F x, uint32_t key, int64_t index) {
    constexpr int W = Vec::W;
    float tmp[W];
    Vec::store(tmp, x);
    const uint32_t hi = uint32_t(uint64_t(index) >> 32) * 0x85EBCA77u;
    for (int k = 0; k < W; ++k) {
      uint32_t u;
      __builtin_memcpy(&u, &tmp[k], 4);
      uint32_t h = key ^ (uint32_t(uint64_t(index) + uint64_t(k)) * 0x9E3779B9u) ^ hi;
      h ^= h >> 16;
      h *= 0x85EBCA6Bu;
      h ^= h >> 13;
      h *= 0xC2B2AE35u;
      h ^= h >> 16;
      const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
      dst[k].bits = nan ? uint16_t(0x7FC0) : uint16_t((u + (h >> 16)) >> 16);
    }
  }
};

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
  // Two independent vectors per iteration: the divide/sqrt chain of one hides the other's latency.
  for (; i + 2 * W <= end; i += 2 * W) {
    F p0 = Vec::load(p + i), p1 = Vec::load(p + i + W);
    F s0[K], s1[K];
    for (int k = 0; k < K; ++k) {
      s0[k] = Vec::load(st[k] + i);
      s1[k] = Vec::load(st[k] + i + W);
    }
    rule(p0, Vec::load(g + i), s0);
    rule(p1, Vec::load(g + i + W), s1);
    ParamStorage<PS>::store(p + i, p0, key, i);
    ParamStorage<PS>::store(p + i + W, p1, key, i + W);
    for (int k = 0; k < K; ++k) {
      Vec::store(st[k] + i, s0[k]);
      Vec::store(st[k] + i + W, s1[k]);
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

inline IsaTable make_table(const char* name) {
  IsaTable t{};
  t.name = name;
#define MFA_FILL_ROW(id, rname, functor, scalars, states)                                       \
  static_assert(functor::kStates == (states) && (states) <= kMaxStates, "state count of " rname); \
  static_assert(std::is_same<functor::Scalars, scalars>::value, "scalar struct of " rname);      \
  fill_row<functor>(t.fn[int(RuleId::id)]);
  MFA_RULES(MFA_FILL_ROW)
#undef MFA_FILL_ROW
  return t;
}
