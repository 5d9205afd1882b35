// Fused Adam/AdamW step for Apple GPUs: one pass over memory per tensor, math in fp32.
//
// The numeric contract is DESIGN.md section 2; the operation order below is that of
// python/mps_fused_adam/reference.py. Contraction into fma is off in every build of this text:
// the metallib is compiled with -fno-fast-math -ffp-contract=off (cmake/apple_metal.cmake), and
// the pragmas below say it again for tier 3, which torch compiles at run time with its own options
// (language 3.1 on macOS 14). Square root and division use metal::precise:: forms, which stay
// correctly rounded even when torch compiles with fast math (PYTORCH_MPS_FAST_MATH=1); fast math
// can still change NaN/Inf handling and subnormals there. Apple GPUs may flush fp32 subnormals, so
// the GPU is held to the contract's bound, not to bit identity (the self-check reports the measured
// agreement); the host emulator of the tests matches the reference bit for bit.
//
// Self-contained on purpose: tier 3 hands this text to torch.mps.compile_shader, and the tests
// compile it as C++17 through tests/metal_compat.h (FUSED_ADAM_HOST_EMULATOR is then defined).
//
// Kernels (host names): fused_adam_<P>_<S>, P = param/grad storage type, S = state storage type:
//   fused_adam_float_float, fused_adam_half_float, fused_adam_half_half,
//   fused_adam_bfloat_float, fused_adam_bfloat_bfloat (the bfloat ones need Metal 3.1, macOS 14).
// Buffers:
//   0 param (P, in/out)   1 grad (P, in)   2 exp_avg (S, in/out)   3 exp_avg_sq (S, in/out)
//   4 AdamParams (constant struct: 9 floats, 2 uints, in contract.KernelScalars order)
//   5 base: ulong, element index of this dispatch's first element (the grid offset)
//   6 n:    ulong, elements in the tensor; elements [base + 4*tid, +4) belong to thread tid
// A dispatch of T threads covers elements [base, min(base + 4*T, n)). Indices are 64-bit, and the
// host splits a tensor into dispatches of at most 2^30 threads by advancing base, so tensors past
// 2^32 elements index correctly while thread_position_in_grid stays a 32-bit uint.

#ifndef FUSED_ADAM_HOST_EMULATOR
#include <metal_stdlib>
using namespace metal;
// No contraction, in the forms the MSL specification documents: the standard pragma for every
// language version, and from 3.2 on the METAL fp pragmas (with safe math mode).
#pragma STDC FP_CONTRACT OFF
#if __METAL_VERSION__ >= 320
#pragma METAL fp math_mode(safe)
#pragma METAL fp contract(off)
#endif
#endif

struct AdamParams {
  float lr;
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float bc1;  // 1 - beta1^step, or 1 without bias correction (computed on the host in double)
  float bc2;
  uint adam_w_mode;
  uint maximize;
};

struct AdamResult {
  float p;
  float m;
  float v;
};

// The whole per-element contract; both the vector body and the tail call it.
inline AdamResult adam_math(float p, float g, float m, float v, constant AdamParams& hp) {
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
  m = hp.beta1 * m + hp.one_minus_beta1 * g;
  v = hp.beta2 * v + hp.one_minus_beta2 * g * g;
  const float denom = sqrt(v / hp.bc2) + hp.eps;
  float update = (m / hp.bc1) / denom;
  if (hp.adam_w_mode != 0) {
    update = update + hp.weight_decay * p;
  }
  AdamResult r;
  r.p = p - hp.lr * update;
  r.m = m;
  r.v = v;
  return r;
}

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

template <typename P, typename S>
kernel void fused_adam(device P* param [[buffer(0)]],
                       device const P* grad [[buffer(1)]],
                       device S* exp_avg [[buffer(2)]],
                       device S* exp_avg_sq [[buffer(3)]],
                       constant AdamParams& hp [[buffer(4)]],
                       constant ulong& base [[buffer(5)]],
                       constant ulong& n [[buffer(6)]],
                       uint tid [[thread_position_in_grid]]) {
  const ulong i = base + ulong(tid) * 4;
  if (i + 4 <= n) {
    float4 p = load4(param + i);
    const float4 g = load4(grad + i);
    float4 m = load4(exp_avg + i);
    float4 v = load4(exp_avg_sq + i);
    for (uint k = 0; k < 4; ++k) {
      const AdamResult r = adam_math(p[k], g[k], m[k], v[k], hp);
      p[k] = r.p;
      m[k] = r.m;
      v[k] = r.v;
    }
    store4(param + i, p);
    store4(exp_avg + i, m);
    store4(exp_avg_sq + i, v);
  } else {
    // The last thread of a tensor whose size is not a multiple of 4 (threads past n do nothing).
    for (ulong j = i; j < n; ++j) {
      const AdamResult r = adam_math(float(param[j]), float(grad[j]), float(exp_avg[j]),
                                     float(exp_avg_sq[j]), hp);
      param[j] = P(r.p);
      exp_avg[j] = S(r.m);
      exp_avg_sq[j] = S(r.v);
    }
  }
}

#define FUSED_ADAM_INSTANTIATE(NAME, P, S) \
  template [[host_name(NAME)]] [[kernel]] decltype(fused_adam<P, S>) fused_adam<P, S>;

FUSED_ADAM_INSTANTIATE("fused_adam_float_float", float, float)
FUSED_ADAM_INSTANTIATE("fused_adam_half_float", half, float)
FUSED_ADAM_INSTANTIATE("fused_adam_half_half", half, half)
#if __METAL_VERSION__ >= 310
FUSED_ADAM_INSTANTIATE("fused_adam_bfloat_float", bfloat, float)
FUSED_ADAM_INSTANTIATE("fused_adam_bfloat_bfloat", bfloat, bfloat)
#endif
