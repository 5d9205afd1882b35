// The CPU kernel's span loop, generic over the update rule, instantiated per ISA from the rule
// list (adam_types.h MFA_RULES) and the dtype pairs. Included by each adam_<isa>.cpp after it has
// defined `Vec` for its ISA, inside a namespace of its own, so templates built with different -m
// flags never merge at link time.
#pragma once

#include "rules.h"

template <class Rule, class P, class S>
void span_kernel(const Span& sp, int64_t begin, int64_t end, const void* scalars) {
  constexpr int W = Vec::W;
  constexpr int K = Rule::kStates;
  using F = typename Vec::F;
  const Rule rule(*static_cast<const typename Rule::Scalars*>(scalars));
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
    Vec::store(p + i, p0);
    Vec::store(p + i + W, p1);
    for (int k = 0; k < K; ++k) {
      Vec::store(st[k] + i, s0[k]);
      Vec::store(st[k] + i + W, s1[k]);
    }
  }
  for (; i + W <= end; i += W) {
    F pv = Vec::load(p + i), sv[K];
    for (int k = 0; k < K; ++k) sv[k] = Vec::load(st[k] + i);
    rule(pv, Vec::load(g + i), sv);
    Vec::store(p + i, pv);
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
    Vec::store(pb, pv);
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
