// Fused Adam/AdamW step for Apple GPUs: one pass over memory per tensor, math in fp32.
//
// The numeric contract is DESIGN.md section 2; the operation order below is that of
// python/mps_fused_adam/reference.py, so an fp32 build agrees with the reference bit for bit
// (contraction into fma is switched off below and by the build's -ffp-contract=off).
//
// Self-contained on purpose: tier 3 hands this text to torch.mps.compile_shader, and the tests
// compile it as C++17 through tests/metal_compat.h (FUSED_ADAM_HOST_EMULATOR is then defined).
//
// Kernels (host names): fused_<rule>_<P>_<S>, P = param/grad storage type, S = state storage
// type, from the instantiation lists at the end (one line per rule x dtype pair):
//   fused_adam_float_float, fused_adam_half_float, fused_adam_half_half,
//   fused_adam_bfloat_float, fused_adam_bfloat_bfloat (the bfloat ones need Metal 3.1, macOS 14).
// Buffers, for a rule with K states (Adam: K = 2):
//   0 param (P, in/out)   1 grad (P, in)   2 .. 1+K the states (S, in/out)
//   2+K the rule's Params (constant struct; Adam: 9 floats, 2 uints, in contract.AdamScalars order)
//   3+K base: ulong, element index of this dispatch's first element (the grid offset)
//   4+K n:    ulong, elements in the tensor; elements [base + 4*tid, +4) belong to thread tid
// A dispatch of T threads covers elements [base, min(base + 4*T, n)). Indices are 64-bit, and the
// host splits a tensor into dispatches of at most 2^30 threads by advancing base, so tensors past
// 2^32 elements index correctly while thread_position_in_grid stays a 32-bit uint.
//
// Adding a rule: a struct like AdamRule below (kStates, Params, an inline apply() in the
// contract's operation order, precise sqrt/divide) and its lines in the instantiation lists; a
// rule with one state uses the one-state kernel shape (add it next to fused_step_2 when the
// first such rule arrives: the same body with buffers 0-2 for tensors, 3-5 for the rest).

#ifndef FUSED_ADAM_HOST_EMULATOR
#include <metal_stdlib>
using namespace metal;
#if __METAL_VERSION__ >= 320
// IEEE math and no contraction whatever the compile options: tier 3 compiles this text at run time
// with options chosen by torch, not by us. (The metallib is also built with -fno-fast-math.)
#pragma METAL fp math_mode(safe)
#pragma METAL fp contract(off)
#endif
#endif

// Adam, numeric contract v2 (python/mps_fused_adam/contract.py): one precise sqrt and one precise
// division per element; every other scalar comes from the host (computed in double, rounded once).
struct AdamParams {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float step_size;  // lr / (1 - beta1^step), or lr without bias correction
  float d2;         // 1 / sqrt(1 - beta2^step), or 1 without bias correction
  float decay;      // 1 - lr * weight_decay in AdamW mode, 1 in L2 mode
  uint adam_w_mode;
  uint maximize;
};

struct AdamRule {
  enum : uint { kStates = 2 };
  typedef AdamParams Params;
  // The whole per-element contract; s[0] = exp_avg, s[1] = exp_avg_sq.
  static inline void apply(thread float& p, float g, thread float* s, constant Params& hp) {
#if defined(__clang__)
    // Each multiply and add rounded separately, as in the reference: tier 3's run-time compile
    // cannot be given -ffp-contract=off, so the source says it too.
#pragma clang fp contract(off)
#endif
    if (hp.maximize != 0) {
      g = -g;
    }
    if (hp.adam_w_mode == 0) {
      g = g + hp.weight_decay * p;
    }
    const float m = hp.beta1 * s[0] + hp.one_minus_beta1 * g;
    const float v = hp.beta2 * s[1] + hp.one_minus_beta2 * (g * g);
    const float denom = metal::precise::sqrt(v) * hp.d2 + hp.eps;
    if (hp.adam_w_mode != 0) {
      p = p * hp.decay;
    }
    p = p - hp.step_size * metal::precise::divide(m, denom);
    s[0] = m;
    s[1] = v;
  }
};

// Four elements per thread through packed vectors: packed types need only the scalar's alignment,
// so a tensor at any storage offset is read with wide loads and no misaligned access.
template <typename T> struct Vec4;
template <> struct Vec4<float> {
  typedef packed_float4 packed;
  typedef float4 vec;
};
template <> struct Vec4<half> {
  typedef packed_half4 packed;
  typedef half4 vec;
};
#if __METAL_VERSION__ >= 310
template <> struct Vec4<bfloat> {
  typedef packed_bfloat4 packed;
  typedef bfloat4 vec;
};
#endif

template <typename T>
inline float4 load4(device const T* src) {
  return float4(typename Vec4<T>::vec(*(device const typename Vec4<T>::packed*)src));
}

// The float -> half/bfloat conversion rounds to nearest even (Metal's default rounding mode).
template <typename T>
inline void store4(device T* dst, float4 x) {
  *(device typename Vec4<T>::packed*)dst = typename Vec4<T>::packed(typename Vec4<T>::vec(x));
}

// The body every kernel shape shares: four elements per thread, the rule applied to each. The
// rule's states are s0 (and s1 for two-state rules; one-state shapes pass s0 twice, unused).
template <typename Rule, typename P, typename S>
inline void step_elements(device P* param, device const P* grad, device S* s0, device S* s1,
                          constant typename Rule::Params& hp, ulong base, ulong n, uint tid) {
  const ulong i = base + ulong(tid) * 4;
  if (i + 4 <= n) {
    float4 p = load4(param + i);
    const float4 g = load4(grad + i);
    float4 m = load4(s0 + i);
    float4 v = Rule::kStates > 1 ? load4(s1 + i) : float4(0.0f);
    for (uint e = 0; e < 4; ++e) {
      float pe = p[e];
      float se[2] = {m[e], v[e]};
      Rule::apply(pe, g[e], se, hp);
      p[e] = pe;
      m[e] = se[0];
      v[e] = se[1];
    }
    store4(param + i, p);
    store4(s0 + i, m);
    if (Rule::kStates > 1) {
      store4(s1 + i, v);
    }
  } else {
    // The last thread of a tensor whose size is not a multiple of 4 (threads past n do nothing).
    for (ulong j = i; j < n; ++j) {
      float pe = float(param[j]);
      float se[2] = {float(s0[j]), Rule::kStates > 1 ? float(s1[j]) : 0.0f};
      Rule::apply(pe, float(grad[j]), se, hp);
      param[j] = P(pe);
      s0[j] = S(se[0]);
      if (Rule::kStates > 1) {
        s1[j] = S(se[1]);
      }
    }
  }
}

// The kernel shape of rules with two states.
template <typename Rule, typename P, typename S>
kernel void fused_step_2(device P* param [[buffer(0)]],
                         device const P* grad [[buffer(1)]],
                         device S* state0 [[buffer(2)]],
                         device S* state1 [[buffer(3)]],
                         constant typename Rule::Params& hp [[buffer(4)]],
                         constant ulong& base [[buffer(5)]],
                         constant ulong& n [[buffer(6)]],
                         uint tid [[thread_position_in_grid]]) {
  step_elements<Rule, P, S>(param, grad, state0, state1, hp, base, n, tid);
}

// The instantiation lists: X(kernel shape, rule struct, rule name, P, S), one line per rule x
// dtype pair; host name fused_<rule>_<P>_<S>. The host emulator expands the same lists.
#define FUSED_KERNELS(X)                   \
  X(fused_step_2, AdamRule, adam, float, float) \
  X(fused_step_2, AdamRule, adam, half, float)  \
  X(fused_step_2, AdamRule, adam, half, half)
// bfloat needs Metal 3.1 (macOS 14).
#define FUSED_KERNELS_BFLOAT(X)                  \
  X(fused_step_2, AdamRule, adam, bfloat, float) \
  X(fused_step_2, AdamRule, adam, bfloat, bfloat)

#define FUSED_INSTANTIATE(SHAPE, RULE, NAME, P, S)                                   \
  template [[host_name("fused_" #NAME "_" #P "_" #S)]] [[kernel]] decltype(SHAPE<RULE, P, S>) \
      SHAPE<RULE, P, S>;

FUSED_KERNELS(FUSED_INSTANTIATE)
#if __METAL_VERSION__ >= 310
FUSED_KERNELS_BFLOAT(FUSED_INSTANTIATE)
#endif
