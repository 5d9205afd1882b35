// The CPU Adam kernel: one source of truth for the math, instantiated per ISA.
// Included by each adam_<isa>.cpp after it has defined `Vec` for its ISA, inside a namespace of
// its own, so templates built with different -m flags never merge at link time.
#pragma once

// Per element, DESIGN.md section 2, in exactly the reference's operation order. The sources are
// built with -ffp-contract=off: a fused multiply-add would round differently from the scalar
// path, from the Metal kernel and from the Python reference.
// (Dividing by the bias corrections as a double multiply by their reciprocal gives the same bits,
// but measured slower on the AVX-512 machine: the conversions cost more than the divisions.)
struct AdamMath {
  using F = Vec::F;
  F lr, beta1, beta2, omb1, omb2, eps, wd, bc1, bc2;
  bool adam_w_mode, maximize;
  explicit AdamMath(const Scalars& s)
      : lr(Vec::set1(s.lr)), beta1(Vec::set1(s.beta1)), beta2(Vec::set1(s.beta2)),
        omb1(Vec::set1(s.one_minus_beta1)), omb2(Vec::set1(s.one_minus_beta2)), eps(Vec::set1(s.eps)),
        wd(Vec::set1(s.weight_decay)), bc1(Vec::set1(s.bc1)), bc2(Vec::set1(s.bc2)),
        adam_w_mode(s.adam_w_mode), maximize(s.maximize) {}
  inline void operator()(F& p, F g, F& m, F& v) const {
    if (maximize) g = Vec::neg(g);
    if (!adam_w_mode) g = g + wd * p;
    m = beta1 * m + omb1 * g;
    v = beta2 * v + omb2 * g * g;
    F denom = Vec::sqrt(v / bc2) + eps;
    F update = (m / bc1) / denom;
    if (adam_w_mode) update = update + wd * p;
    p = p - lr * update;
  }
};

// The memory floor: Adam's access pattern (4 reads, 3 in-place writes) with trivial math.
struct FloorMath {
  using F = Vec::F;
  explicit FloorMath(const Scalars&) {}
  inline void operator()(F& p, F g, F& m, F& v) const {
    m = m + g;
    v = v + g;
    p = p + m;
  }
};

template <class Math, class P, class S>
void span_kernel(const Span& sp, int64_t begin, int64_t end, const Scalars& s) {
  constexpr int W = Vec::W;
  const Math math(s);
  P* p = static_cast<P*>(sp.param);
  const P* g = static_cast<const P*>(sp.grad);
  S* m = static_cast<S*>(sp.exp_avg);
  S* v = static_cast<S*>(sp.exp_avg_sq);
  int64_t i = begin;
  // Two independent vectors per iteration: the divide/sqrt chain of one hides the other's latency.
  for (; i + 2 * W <= end; i += 2 * W) {
    typename Vec::F p0 = Vec::load(p + i), m0 = Vec::load(m + i), v0 = Vec::load(v + i);
    typename Vec::F p1 = Vec::load(p + i + W), m1 = Vec::load(m + i + W), v1 = Vec::load(v + i + W);
    math(p0, Vec::load(g + i), m0, v0);
    math(p1, Vec::load(g + i + W), m1, v1);
    Vec::store(p + i, p0);
    Vec::store(m + i, m0);
    Vec::store(v + i, v0);
    Vec::store(p + i + W, p1);
    Vec::store(m + i + W, m1);
    Vec::store(v + i + W, v1);
  }
  for (; i + W <= end; i += W) {
    typename Vec::F pv = Vec::load(p + i), mv = Vec::load(m + i), vv = Vec::load(v + i);
    math(pv, Vec::load(g + i), mv, vv);
    Vec::store(p + i, pv);
    Vec::store(m + i, mv);
    Vec::store(v + i, vv);
  }
  if (i < end) {
    // The tail goes through the same vector math on zero-padded copies, so every element of
    // every path sees the identical instruction sequence.
    const int64_t r = end - i;
    P pb[W] = {}, gb[W] = {};
    S mb[W] = {}, vb[W] = {};
    for (int64_t k = 0; k < r; ++k) { pb[k] = p[i + k]; gb[k] = g[i + k]; mb[k] = m[i + k]; vb[k] = v[i + k]; }
    typename Vec::F pv = Vec::load(pb), mv = Vec::load(mb), vv = Vec::load(vb);
    math(pv, Vec::load(gb), mv, vv);
    Vec::store(pb, pv);
    Vec::store(mb, mv);
    Vec::store(vb, vv);
    for (int64_t k = 0; k < r; ++k) { p[i + k] = pb[k]; m[i + k] = mb[k]; v[i + k] = vb[k]; }
  }
}

template <class Math>
inline void fill_row(SpanFn (&row)[static_cast<int>(Combo::Count)]) {
  
  row[int(Combo::F32_F32)] = span_kernel<Math, float, float>;
  row[int(Combo::F16_F32)] = span_kernel<Math, mfa::f16, float>;
  row[int(Combo::F16_F16)] = span_kernel<Math, mfa::f16, mfa::f16>;
  row[int(Combo::BF16_F32)] = span_kernel<Math, mfa::bf16, float>;
  row[int(Combo::BF16_BF16)] = span_kernel<Math, mfa::bf16, mfa::bf16>;
}

inline IsaTable make_table(const char* name) {
  IsaTable t{};
  t.name = name;
  fill_row<AdamMath>(t.adam);
  fill_row<FloorMath>(t.floor);
  return t;
}
