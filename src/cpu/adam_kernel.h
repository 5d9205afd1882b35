// The CPU kernel's span loop, generic over the update rule, instantiated per ISA from the rule
// list (adam_types.h MFA_RULES) and the dtype pairs. Included by each adam_<isa>.cpp after it has
// defined `Vec` for its ISA, inside a namespace of its own, so templates built with different -m
// flags never merge at link time.
#pragma once

#include "rules.h"

// Vectors per loop iteration, and how far ahead (bytes) to prefetch each stream (0: leave it to
// the hardware prefetchers). Build-time knobs for tuning; the defaults are the measured choice
// (16-core Xeon, AVX-512, one interleaved benchmark run each: prefetching 1 KiB ahead took the
// flat cases at 4 threads from 0.89-0.93 of the memory floor to 0.91-0.94, at 1 thread from
// 0.85-0.94 to 0.86-1.01; unrolling 4 vectors instead of 2 was no better).
#ifndef MFA_UNROLL
#define MFA_UNROLL 2
#endif
#ifndef MFA_PREFETCH
#define MFA_PREFETCH 1024
#endif

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
  // U independent vectors per iteration: the divide/sqrt chain of one hides the others' latency.
  constexpr int U = MFA_UNROLL;
  for (; i + U * W <= end; i += U * W) {
    if (MFA_PREFETCH > 0) {
      for (int u = 0; u < U; ++u) {
        __builtin_prefetch(p + i + u * W + MFA_PREFETCH / int(sizeof(P)), 1);
        __builtin_prefetch(g + i + u * W + MFA_PREFETCH / int(sizeof(P)), 0);
        for (int k = 0; k < K; ++k) __builtin_prefetch(st[k] + i + u * W + MFA_PREFETCH / int(sizeof(S)), 1);
      }
    }
    F pv[U], sv[U][K];
    for (int u = 0; u < U; ++u) {
      pv[u] = Vec::load(p + i + u * W);
      for (int k = 0; k < K; ++k) sv[u][k] = Vec::load(st[k] + i + u * W);
    }
    for (int u = 0; u < U; ++u) rule(pv[u], Vec::load(g + i + u * W), sv[u]);
    for (int u = 0; u < U; ++u) {
      Vec::store(p + i + u * W, pv[u]);
      for (int k = 0; k < K; ++k) Vec::store(st[k] + i + u * W, sv[u][k]);
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
