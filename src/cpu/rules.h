// The update rules as functors over one ISA's vectors: the only place the CPU kernel does math.
// Included by each adam_<isa>.cpp, after it has defined `Vec`, inside a namespace of its own.
// Each rule: kStates, its Scalars struct (adam_types.h), a constructor from it, and
// operator()(F& p, F g, F* s) updating the param and its kStates states in place.
#pragma once

// Adam, numeric contract v2 (contract.py), in exactly the reference's operation order. The
// sources are built with -ffp-contract=off: a fused multiply-add would round differently from
// the scalar path, from the Metal kernel and from the Python reference. One sqrt and one
// division per element; every other scalar comes from the host.
struct AdamRule {
  static constexpr int kStates = 2;
  using Scalars = AdamScalars;
  using F = Vec::F;
  F beta1, beta2, omb1, omb2, eps, wd, step_size, d2, decay;
  bool adam_w_mode, maximize;
  // S: AdamScalars, or any struct with its fields (the 8-bit kernel's Adam8bitScalars).
  template <class S>
  explicit AdamRule(const S& s)
      : beta1(Vec::set1(s.beta1)), beta2(Vec::set1(s.beta2)), omb1(Vec::set1(s.one_minus_beta1)),
        omb2(Vec::set1(s.one_minus_beta2)), eps(Vec::set1(s.eps)), wd(Vec::set1(s.weight_decay)),
        step_size(Vec::set1(s.step_size)), d2(Vec::set1(s.d2)), decay(Vec::set1(s.decay)),
        adam_w_mode(s.adam_w_mode != 0), maximize(s.maximize != 0) {}
  // The element math, the one statement of it in C++; `clamp` maps the normalized step m / denom
  // (the 8-bit rule's clamp to [-clip, clip], adam8bit_kernel.h; the identity here).
  template <class Clamp>
  inline void step(F& p, F g, F& m, F& v, Clamp clamp) const {
    if (maximize) g = Vec::neg(g);
    if (!adam_w_mode) g = g + wd * p;
    m = beta1 * m + omb1 * g;
    v = beta2 * v + omb2 * (g * g);
    F denom = Vec::sqrt(v) * d2 + eps;
    if (adam_w_mode) p = p * decay;
    p = p - step_size * clamp(m / denom);
  }
  inline void operator()(F& p, F g, F* s) const {
    step(p, g, s[0], s[1], [](F u) { return u; });
  }
};

// Lion (contract.py): no sqrt, no division. sign(c) is 1, -1, +0 for both zeros, NaN for NaN
// (Vec::sign); lr * sign(c) is exact, so the parameter update rounds once. Vec::signed_lr gives
// the same bits in fewer operations where lr's sign bit is clear (every validated lr; a negative
// one, which only DeepSpeed's unvalidated op calls could pass, takes the product).
struct LionRule {
  static constexpr int kStates = 1;
  using Scalars = LionScalars;
  using F = Vec::F;
  F lr, beta1, beta2, omb1, omb2, decay;
  bool maximize, lr_sign_clear;
  static bool sign_clear(float x) {
    uint32_t u;
    __builtin_memcpy(&u, &x, sizeof u);
    return (u >> 31) == 0;
  }
  explicit LionRule(const Scalars& s)
      : lr(Vec::set1(s.lr)), beta1(Vec::set1(s.beta1)), beta2(Vec::set1(s.beta2)),
        omb1(Vec::set1(s.one_minus_beta1)), omb2(Vec::set1(s.one_minus_beta2)), decay(Vec::set1(s.decay)),
        maximize(s.maximize != 0), lr_sign_clear(sign_clear(s.lr)) {}
  inline void operator()(F& p, F g, F* s) const {
    F& m = s[0];
    if (maximize) g = Vec::neg(g);
    F c = beta1 * m + omb1 * g;
    p = p * decay;
    p = p - (lr_sign_clear ? Vec::signed_lr(lr, c) : lr * Vec::sign(c));
    m = beta2 * m + omb2 * g;
  }
};

// Adagrad (torch.optim.Adagrad's algorithm, contract.py): one sqrt, one division. The quotient
// g / (sqrt(s) + eps) lies in [-1, 1], so multiplying it by the step size cannot overflow.
struct AdagradRule {
  static constexpr int kStates = 1;
  using Scalars = AdagradScalars;
  using F = Vec::F;
  F clr, eps, wd;
  bool l2, maximize;
  explicit AdagradRule(const Scalars& s)
      : clr(Vec::set1(s.clr)), eps(Vec::set1(s.eps)), wd(Vec::set1(s.weight_decay)), l2(s.l2 != 0),
        maximize(s.maximize != 0) {}
  inline void operator()(F& p, F g, F* s) const {
    F& acc = s[0];
    if (maximize) g = Vec::neg(g);
    if (l2) g = g + wd * p;
    acc = acc + g * g;
    p = p - clr * (g / (Vec::sqrt(acc) + eps));
  }
};

// The memory floor of one-state rules (Lion, Adagrad): 3 reads, 2 in-place writes, trivial math
// that leaves every value as it was (x + g * 0: only a -0 may become +0), so the benchmark can run
// it on the very tensors the optimizers use: on a virtual machine, separately allocated tensors
// can sit on memory of different speed. The zero comes from the scalars (lr - lr, finite in the
// benchmark), so the compiler cannot drop the arithmetic, nor the stores with it.
struct Floor1Rule {
  static constexpr int kStates = 1;
  using Scalars = LionScalars;
  using F = Vec::F;
  F zero;
  explicit Floor1Rule(const Scalars& s) : zero(Vec::set1(s.lr - s.lr)) {}
  inline void operator()(F& p, F g, F* s) const {
    const F t = g * zero;
    s[0] = s[0] + t;
    p = p + t;
  }
};

// The memory floor: Adam's access pattern (4 reads, 3 in-place writes) with the same trivial,
// value-keeping math (Floor1Rule).
struct FloorRule {
  static constexpr int kStates = 2;
  using Scalars = AdamScalars;
  using F = Vec::F;
  F zero;
  explicit FloorRule(const Scalars& s) : zero(Vec::set1(s.weight_decay - s.weight_decay)) {}
  inline void operator()(F& p, F g, F* s) const {
    const F t = g * zero;
    s[0] = s[0] + t;
    s[1] = s[1] + t;
    p = p + t;
  }
};
