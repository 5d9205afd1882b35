// Fused optimizer steps (Adam/AdamW, Lion, Adagrad) for Apple GPUs: one pass over memory per
// tensor, math in fp32.
//
// The numeric contract is docs/numerics.md; the operation order below is that of
// python/mps_fused_adam/numerics/reference.py. Contraction into fma is off in every build of this text:
// the metallib is compiled with -fno-fast-math -ffp-contract=off (cmake/apple_metal.cmake), and
// the pragmas below say it again for tier 3, which torch compiles at run time with its own options
// (language 3.1 on macOS 14). Square root and division use metal::precise:: forms, which stay
// correctly rounded even when torch compiles with fast math (PYTORCH_MPS_FAST_MATH=1); fast math
// can still change NaN/Inf handling and subnormals there. Apple GPUs may flush fp32 subnormals, so
// the GPU is held to the contract's bound, not to bit identity (the self-check reports the measured
// agreement); the host emulator of the tests matches the reference bit for bit.
//
// Self-contained on purpose: tier 3 hands this text to torch.mps.compile_shader, and the tests
// compile it as C++17 through tests/support/metal_compat.h (FUSED_ADAM_HOST_EMULATOR is then defined).
//
// Kernels (host names): fused_<rule>_<P>_<S>, P = param/grad storage type, S = state storage
// type, from the instantiation lists at the end (one line per rule x dtype pair):
//   fused_adam_float_float, fused_adam_half_float, fused_adam_half_half,
//   fused_adam_bfloat_float, fused_adam_bfloat_bfloat (the bfloat ones need Metal 3.1, macOS 14),
//   the same five pairs of fused_lion_* and fused_adagrad_*, and fused_adam_sr_bfloat_float,
//   fused_adam_sr_bfloat_bfloat (Adam, the bf16 param stored by stochastic rounding), and
//   fused_adam8bit_{float,half,bfloat}_uchar and fused_adam4bit_{float,half,bfloat}_uchar (8-bit
//   and 4-bit block-wise Adam: buffers at fused_step_blockwise).
// Buffers, for a rule with K states (Adam: K = 2; Lion, Adagrad: K = 1):
//   0 param (P, in/out)   1 grad (P, in)   2 .. 1+K the states (S, in/out)
//   2+K the rule's Params (constant struct; Adam: 9 floats, 2 uints, in contract.AdamScalars order)
//   3+K base: ulong, element index of this dispatch's first element (the grid offset)
//   4+K n:    ulong, elements in the tensor; elements [base + 4*tid, +4) belong to thread tid
// A dispatch of T threads covers elements [base, min(base + 4*T, n)). Indices are 64-bit, and the
// host splits a tensor into dispatches of at most 2^30 threads by advancing base, so tensors past
// 2^32 elements index correctly while thread_position_in_grid stays a 32-bit uint.
//
// Adding a rule: a struct like AdamRule below (kStates, Params, an inline apply() in the
// contract's operation order, precise sqrt/divide) and one line in FUSED_RULES at the end, which
// instantiates it for every dtype pair with the kernel shape of its state count (fused_step_2,
// or fused_step_1: buffers 0-2 for tensors, 3-5 for the rest). Its Params struct is written from
// its contract.py NamedTuple by ci/scalar_structs.py into the marked block below (this file
// includes nothing of ours: tier 3 compiles its text as it is).

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

// The rules' Params structs, fields named and ordered as numerics/contract.py's NamedTuples (the
// C++ kernel's structs in src/cpu/adam_types.h are written from the same source).
// BEGIN scalar structs: written by ci/scalar_structs.py from numerics/contract.py; do not edit
// Adam (contract.AdamScalars).
struct AdamParams {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float step_size;  // lr / bc1, bc1 = 1 - beta1^step (1 without bias correction)
  float d2;  // 1 / sqrt(bc2), bc2 = 1 - beta2^step (1 without bias correction)
  float decay;  // 1 - lr * wd in AdamW mode, 1 in L2 mode
  uint adam_w_mode;
  uint maximize;
};
// Lion (contract.LionScalars).
struct LionParams {
  float lr;
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float decay;  // 1 - lr * weight_decay
  uint maximize;
};
// Adagrad (contract.AdagradScalars).
struct AdagradParams {
  float clr;  // lr / (1 + (step - 1) * lr_decay)
  float eps;
  float weight_decay;
  uint l2;  // weight_decay != 0
  uint maximize;
};
// Adam storing a bf16 param by stochastic rounding (contract.adam_sr_scalars).
struct AdamSRParams {
  AdamParams adam;
  uint sr_key;  // lowbit.sr_key(seed, step) of the tensor
};
// 8-bit Adam on Metal (contract.adam8bit_tensor_scalars).
struct Adam8bitParams {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float step_size;  // lr / bc1
  float d2;  // 1 / sqrt(bc2)
  float decay;  // 1 - lr * wd in AdamW mode, 1 in L2 mode
  float clip;  // bound of |m / denom| (normalized_step_bound, rounded up)
  uint adam_w_mode;
  uint maximize;
  uint sr;  // bf16 params only: store by stochastic rounding with sr_key
  uint sr_key;
};
// END scalar structs

// Adam, numeric contract v2 (python/mps_fused_adam/numerics/contract.py): one precise sqrt and one precise
// division per element; every other scalar comes from the host (computed in double, rounded once).
// The normalized step m / denom as Adam takes it (NoClamp), or clamped to [-clip, clip] as the
// 8-bit rule takes it (ClampToClip: H has a clip field; NaN stays NaN).
struct NoClamp {
  template <typename H>
  static inline float apply(float u, constant H&) { return u; }
};
struct ClampToClip {
  template <typename H>
  static inline float apply(float u, constant H& hp) {
    if (u > hp.clip) {
      u = hp.clip;
    }
    if (u < -hp.clip) {
      u = -hp.clip;
    }
    return u;
  }
};

struct AdamRule {
  enum : uint { kStates = 2 };
  typedef AdamParams Params;
  // The whole per-element contract, the one statement of it in Metal: m, v the moments in and
  // out; H is AdamParams or a struct with its fields (Adam8bitParams), Clamp as above.
  template <typename Clamp, typename H>
  static inline void step(thread float& p, float g, thread float& m, thread float& v, constant H& hp) {
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
    v = hp.beta2 * v + hp.one_minus_beta2 * (g * g);
    const float denom = metal::precise::sqrt(v) * hp.d2 + hp.eps;
    const float u = Clamp::apply(metal::precise::divide(m, denom), hp);
    if (hp.adam_w_mode != 0) {
      p = p * hp.decay;
    }
    p = p - hp.step_size * u;
  }
  // s[0] = exp_avg, s[1] = exp_avg_sq.
  static inline void apply(thread float& p, float g, thread float* s, constant Params& hp) {
    step<NoClamp>(p, g, s[0], s[1], hp);
  }
};

// Lion (python/mps_fused_adam/numerics/contract.py): no sqrt, no division. sign(c) is 1, -1, +0 for both
// zeros and NaN for NaN (c - c), so a NaN momentum or gradient reaches the parameter.
struct LionRule {
  enum : uint { kStates = 1 };
  typedef LionParams Params;
  // s[0] = exp_avg.
  static inline void apply(thread float& p, float g, thread float* s, constant Params& hp) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    if (hp.maximize != 0) {
      g = -g;
    }
    const float c = hp.beta1 * s[0] + hp.one_minus_beta1 * g;
    const float sign = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c - c);
    p = p * hp.decay;
    p = p - hp.lr * sign;
    s[0] = hp.beta2 * s[0] + hp.one_minus_beta2 * g;
  }
};

// Adagrad (torch.optim.Adagrad's algorithm, contract.py): one precise sqrt, one precise division.
struct AdagradRule {
  enum : uint { kStates = 1 };
  typedef AdagradParams Params;
  // s[0] = sum (of squared gradients).
  static inline void apply(thread float& p, float g, thread float* s, constant Params& hp) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    if (hp.maximize != 0) {
      g = -g;
    }
    if (hp.l2 != 0) {
      g = g + hp.weight_decay * p;
    }
    const float acc = s[0] + g * g;
    p = p - hp.clr * metal::precise::divide(g, metal::precise::sqrt(acc) + hp.eps);
    s[0] = acc;
  }
};

// Adam whose bf16 parameter is stored by stochastic rounding (python/mps_fused_adam/numerics/lowbit.py):
// the Adam math above, then the store of ParamStore<AdamSRRule> below. The key is the tensor's
// lowbit.sr_key(seed, step), so the host dispatches one tensor per struct.
struct AdamSRRule {
  enum : uint { kStates = 2 };
  typedef AdamSRParams Params;
  static inline void apply(thread float& p, float g, thread float* s, constant Params& hp) {
    AdamRule::apply(p, g, s, hp.adam);
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

// How a kernel stores the new parameter: round to nearest even for every rule but AdamSRRule.
template <typename Rule> struct ParamStore {
  template <typename P>
  static inline void store(device P* dst, float4 x, constant typename Rule::Params&, ulong) {
    store4(dst, x);
  }
  template <typename P>
  static inline void store(device P* dst, float x, constant typename Rule::Params&, ulong) {
    *dst = P(x);
  }
};

#if __METAL_VERSION__ >= 310
// Stochastic rounding to bf16 (lowbit.py's contract): (bits(x) + r) >> 16, r the top 16 bits of
// fmix32(key ^ lo * 0x9E3779B9 ^ hi * 0x85EBCA77) for the element index hi:lo in its tensor;
// NaN stores 0x7FC0. Only bfloat params are instantiated with this rule.
template <> struct ParamStore<AdamSRRule> {
  static inline ushort round1(float x, uint key, ulong index) {
    const uint u = as_type<uint>(x);
    uint h = key ^ (uint(index) * 0x9E3779B9u) ^ (uint(index >> 32) * 0x85EBCA77u);
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? ushort(0x7FC0u) : ushort((u + (h >> 16)) >> 16);
  }
  static inline void store(device bfloat* dst, float4 x, constant AdamSRParams& hp, ulong index) {
    for (uint e = 0; e < 4; ++e) {
      store(dst + e, x[e], hp, index + e);
    }
  }
  static inline void store(device bfloat* dst, float x, constant AdamSRParams& hp, ulong index) {
    *(device ushort*)dst = round1(x, hp.sr_key, index);
  }
};
#endif

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
    ParamStore<Rule>::store(param + i, p, hp, i);
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
      ParamStore<Rule>::store(param + j, pe, hp, j);
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
  static_assert(Rule::kStates == 2, "fused_step_2 is the kernel shape of two-state rules");
  step_elements<Rule, P, S>(param, grad, state0, state1, hp, base, n, tid);
}

// The kernel shape of rules with one state (Lion, Adagrad).
template <typename Rule, typename P, typename S>
kernel void fused_step_1(device P* param [[buffer(0)]],
                         device const P* grad [[buffer(1)]],
                         device S* state0 [[buffer(2)]],
                         constant typename Rule::Params& hp [[buffer(3)]],
                         constant ulong& base [[buffer(4)]],
                         constant ulong& n [[buffer(5)]],
                         uint tid [[thread_position_in_grid]]) {
  static_assert(Rule::kStates == 1, "fused_step_1 is the kernel shape of one-state rules");
  step_elements<Rule, P, S>(param, grad, state0, state0, hp, base, n, tid);
}

// Block-wise low-bit Adam: 8-bit (python/mps_fused_adam/numerics/lowbit.py,
// reference_lowbit.reference_adam8bit_) and 4-bit (numerics/lowbit4.py, reference_adam4bit_) states,
// one kernel shape (fused_step_blockwise) over two code formats (Codes8, Nibbles4 below). Both
// moments are stored as codes with one fp32 scale (absmax) per block. The thread whose four
// elements start a block owns the whole block (the others return), so a block's new scales are
// known before any of its codes is written and no threadgroup barrier is needed. The first pass
// finds the new scales without writing; the second recomputes each element (the same operations,
// so the same values), stores the parameter and quantizes. Not tuned for Apple GPUs (one working
// thread per block, private to its block).
// Buffers: 0 param (P)  1 grad (P)  2 exp_avg codes  3 exp_avg_sq codes (uchar)  4, 5 their block
// scales (float)  6, 7 the signed and unsigned map tables (the format's kernel table)
// 8 Adam8bitParams (both formats: the rules differ only in their states)  9 base  10 n.

// The nearest-code search of src/cpu/q8_search.h on a map's kernel table (lowbit.py, "The
// kernels' quantizer"; offsets KT_*): the region of z (fp32 bits of a value >= 0) from its binade
// and one boundary, the region's affine estimate, and one midpoint test. The result is exact
// whatever the estimate's rounding (contracted or flushed), which is only ever off by far less
// than half a code.
inline uint q8_count(uint z, device const float* t, uint zero) {
  const uint e = z >> 23;
  const uint k = (e < 96u ? 96u : (e > 127u ? 127u : e)) - 96u;
  const uint r = as_type<uint>(t[576 + k]) + (z > as_type<uint>(t[608 + k]) ? 1u : 0u);
  const float f = as_type<float>(z) * t[512 + r] - t[528 + r];
  float j = metal::rint(f) - 1.0f;
  if (!(j >= t[560 + r])) {
    j = t[560 + r];  // NaN too (z = inf, in region 8)
  }
  if (j > t[544 + r]) {
    j = t[544 + r];
  }
  const uint top = 254u - zero;  // N: region 8's count N + 1 is M_N's test
  const uint m = j < float(top) ? uint(j) : top;
  return m + (z > as_type<uint>(t[256 + zero + m]) ? 1u : 0u);
}

// The number of midpoints strictly below x (the nearest code, ties to the lower one, NaN -> 0).
// The signed map is symmetric: below a negative x lie 127 minus the midpoints M_j <= |x| (j < N),
// the count below |x|'s next fp32.
inline uint code_of(float x, device const float* table) {
  if (x != x) {
    return 0;
  }
  const uint u = as_type<uint>(x);
  const uint y = u & 0x7FFFFFFFu;
  const bool neg = (u >> 31) != 0;
  if (!(table[0] < 0.0f)) {  // the unsigned map: its midpoints are all positive
    return neg ? 0u : q8_count(y, table, 0u);
  }
  if (neg) {
    const uint p = q8_count(y + 1u, table, 127u);
    return 127u - (p < 127u ? p : 127u);
  }
  return 127u + q8_count(y, table, 127u);
}

// A code format: kBits per code, 2^kPerByteLog2 codes per byte (the first element's code in the
// high bits), 2^kBlockLog2 elements per block, and the quantizer of each moment on its map's
// kernel table. (Shifts rather than divisions: the source has no bare "/", see
// tests/test_metal_sources.py.)
// Codes8: one code per byte, blocks of 256, lowbit.kernel_table (256 values, 255 midpoints, the
// search's constants); a positive second moment never takes the zero code.
struct Codes8 {
  enum : uint { kBits = 8, kPerByteLog2 = 0, kBlockLog2 = 8 };
  static inline uint code1(float x, device const float* table) { return code_of(x, table); }
  static inline uint code2(float x, device const float* table) {
    const uint c = code_of(x, table);
    return c == 0 && x > 0.0f ? 1u : c;
  }
  // The second moment's stored scale: an infinite one already dequantizes its block to NaN
  // (the zero code times inf).
  static inline float scale2(float s) { return s; }
};

// Nibbles4: two codes per byte (byte k = code(2k) << 4 | code(2k + 1)), blocks of 128,
// lowbit4.kernel_table4 (16 values, then 15 midpoints). The second moment's map has no zero, so
// both moments take the plain nearest code.
struct Nibbles4 {
  enum : uint { kBits = 4, kPerByteLog2 = 1, kBlockLog2 = 7 };
  // The number of the 15 sorted midpoints strictly below x, by four halving steps (15 = 2^4 - 1);
  // NaN fails every comparison: code 0.
  static inline uint code1(float x, device const float* table) {
    uint c = 0;
    for (uint step = 8; step != 0; step >>= 1) {
      if (table[16 + c + step - 1] < x) {
        c += step;
      }
    }
    return c;
  }
  static inline uint code2(float x, device const float* table) { return code1(x, table); }
  // The second moment's stored scale, +inf stored as the NaN 0xFFC00000, so that the block
  // dequantizes to NaN as an 8-bit one does; the zero-free map would give inf and freeze the whole
  // block silently (lowbit4.py, "Quantize one block"). Fixed bits: the sign of a NaN made by
  // arithmetic is the device's.
  static inline float scale2(float s) {
    return as_type<uint>(s) == 0x7F800000u ? as_type<float>(0xFFC00000u) : s;
  }
};

// Code i of a tensor's codes in format Fmt.
template <typename Fmt, typename S>
inline uint load_code(device const S* codes, ulong i) {
  const uint last = (1u << Fmt::kPerByteLog2) - 1u;  // the slot of a byte's last code
  const uint shift = Fmt::kBits * (last - (uint(i) & last));
  return (uint(codes[i >> Fmt::kPerByteLog2]) >> shift) & ((1u << Fmt::kBits) - 1u);
}

template <typename Fmt>
struct AdamBlockwiseRule {
  enum : uint { kStates = 6 };  // two code buffers, two scale buffers, two map tables
  typedef Adam8bitParams Params;
  typedef Fmt Format;
  // The element's Adam step on dequantized moments, the normalized step clamped to [-clip, clip].
  static inline void apply(thread float& p, float g, thread float& m, thread float& v, constant Params& hp) {
    AdamRule::step<ClampToClip>(p, g, m, v, hp);
  }
};
typedef AdamBlockwiseRule<Codes8> Adam8bitRule;
typedef AdamBlockwiseRule<Nibbles4> Adam4bitRule;

// max(acc, a) that turns NaN once any element is NaN (as torch's amax does).
inline float nan_max(float acc, float a) {
  return (a > acc || a != a) && acc == acc ? a : acc;
}

template <typename P>
inline void store_param_lowbit(device P* dst, float x, constant Adam8bitParams&, ulong) {
  *dst = P(x);
}
#if __METAL_VERSION__ >= 310
inline void store_param_lowbit(device bfloat* dst, float x, constant Adam8bitParams& hp, ulong index) {
  if (hp.sr != 0) {
    *(device ushort*)dst = ParamStore<AdamSRRule>::round1(x, hp.sr_key, index);
  } else {
    *dst = bfloat(x);
  }
}
#endif

template <typename Rule, typename P, typename S>
kernel void fused_step_blockwise(device P* param [[buffer(0)]],
                                 device const P* grad [[buffer(1)]],
                                 device S* codes1 [[buffer(2)]],
                                 device S* codes2 [[buffer(3)]],
                                 device float* absmax1 [[buffer(4)]],
                                 device float* absmax2 [[buffer(5)]],
                                 device const float* map1 [[buffer(6)]],
                                 device const float* map2 [[buffer(7)]],
                                 constant typename Rule::Params& hp [[buffer(8)]],
                                 constant ulong& base [[buffer(9)]],
                                 constant ulong& n [[buffer(10)]],
                                 uint tid [[thread_position_in_grid]]) {
  typedef typename Rule::Format Fmt;
  const ulong size = ulong(1) << Fmt::kBlockLog2;
  const uint last = (1u << Fmt::kPerByteLog2) - 1u;  // the slot of a byte's last code
  const ulong lo = base + ulong(tid) * 4;
  if ((lo & (size - 1)) != 0 || lo >= n) {
    return;
  }
  const ulong hi = n - lo < size ? n : lo + size;
  const ulong b = lo >> Fmt::kBlockLog2;
  const float a1 = absmax1[b];
  const float a2 = absmax2[b];
  float mx1 = 0.0f;
  float mx2 = 0.0f;
  for (ulong i = lo; i < hi; ++i) {
    float p = float(param[i]);
    float m = map1[load_code<Fmt>(codes1, i)] * a1;
    float v = map2[load_code<Fmt>(codes2, i)] * a2;
    Rule::apply(p, float(grad[i]), m, v, hp);
    mx1 = nan_max(mx1, metal::fabs(m));  // qualified: libc++'s ::fabs(float) is visible too in C++
    mx2 = nan_max(mx2, metal::fabs(v));
  }
  const float inv1 = mx1 == 0.0f ? 0.0f : metal::precise::divide(1.0f, mx1);
  const float inv2 = mx2 == 0.0f ? 0.0f : metal::precise::divide(1.0f, mx2);
  // A byte's codes are gathered here and stored with its last one (or the tensor's: an odd 4-bit
  // tensor's last byte keeps a zero low nibble), so every code byte is written once, never read back.
  uint byte1 = 0;
  uint byte2 = 0;
  for (ulong i = lo; i < hi; ++i) {
    float p = float(param[i]);
    float m = map1[load_code<Fmt>(codes1, i)] * a1;
    float v = map2[load_code<Fmt>(codes2, i)] * a2;
    Rule::apply(p, float(grad[i]), m, v, hp);
    store_param_lowbit(param + i, p, hp, i);
    byte1 = (byte1 << Fmt::kBits) | Fmt::code1(m * inv1, map1);
    byte2 = (byte2 << Fmt::kBits) | Fmt::code2(v * inv2, map2);
    const uint slot = uint(i) & last;
    if (slot == last || i + 1 == hi) {
      const uint pad = Fmt::kBits * (last - slot);
      codes1[i >> Fmt::kPerByteLog2] = S(byte1 << pad);
      codes2[i >> Fmt::kPerByteLog2] = S(byte2 << pad);
      byte1 = 0;
      byte2 = 0;
    }
  }
  absmax1[b] = mx1;
  absmax2[b] = Fmt::scale2(mx2);
}

// The instantiation lists. FUSED_RULES names each rule once: M(X, rule struct, host name, states);
// its states pick the kernel shape (fused_step_<states>, which static_asserts the struct's
// kStates), and FUSED_PAIRS / FUSED_PAIRS_BFLOAT expand every dtype pair of it. So a new rule is
// its struct above and one line here. FUSED_KERNELS and FUSED_KERNELS_BFLOAT then list
// X(kernel shape, rule struct, host name, P, S), one entry per kernel, host name
// fused_<rule>_<P>_<S>; the host emulator expands the same two lists.
#define FUSED_RULES(M, X)       \
  M(X, AdamRule, adam, 2)       \
  M(X, LionRule, lion, 1)       \
  M(X, AdagradRule, adagrad, 1)
#define FUSED_PAIRS(X, RULE, NAME, STATES)                 \
  X(fused_step_##STATES, RULE, NAME, float, float)         \
  X(fused_step_##STATES, RULE, NAME, half, float)          \
  X(fused_step_##STATES, RULE, NAME, half, half)
// bfloat needs Metal 3.1 (macOS 14).
#define FUSED_PAIRS_BFLOAT(X, RULE, NAME, STATES)          \
  X(fused_step_##STATES, RULE, NAME, bfloat, float)        \
  X(fused_step_##STATES, RULE, NAME, bfloat, bfloat)

// Every rule's plain pairs, then 8-bit and 4-bit Adam (uchar codes; buffers of fused_step_blockwise).
#define FUSED_KERNELS(X)                                            \
  FUSED_RULES(FUSED_PAIRS, X)                                       \
  X(fused_step_blockwise, Adam8bitRule, adam8bit, float, uchar)     \
  X(fused_step_blockwise, Adam8bitRule, adam8bit, half, uchar)      \
  X(fused_step_blockwise, Adam4bitRule, adam4bit, float, uchar)     \
  X(fused_step_blockwise, Adam4bitRule, adam4bit, half, uchar)
// Every rule's bfloat pairs, then those that exist for bfloat params only: Adam storing the param
// by stochastic rounding, and 8-bit and 4-bit Adam's bfloat param.
#define FUSED_KERNELS_BFLOAT(X)                                     \
  FUSED_RULES(FUSED_PAIRS_BFLOAT, X)                                \
  FUSED_PAIRS_BFLOAT(X, AdamSRRule, adam_sr, 2)                     \
  X(fused_step_blockwise, Adam8bitRule, adam8bit, bfloat, uchar)    \
  X(fused_step_blockwise, Adam4bitRule, adam4bit, bfloat, uchar)

// An explicit instantiation's attributes. tests/support/metal_compat.h defines this as nothing before
// including the file: clang's C++ allows no attribute list on an explicit instantiation.
#ifndef FUSED_KERNEL_ATTRIBUTES
#define FUSED_KERNEL_ATTRIBUTES(HOST_NAME) [[host_name(HOST_NAME)]] [[kernel]]
#endif
#define FUSED_INSTANTIATE(SHAPE, RULE, NAME, P, S)                                                  \
  template FUSED_KERNEL_ATTRIBUTES("fused_" #NAME "_" #P "_" #S) decltype(SHAPE<RULE, P, S>) \
      SHAPE<RULE, P, S>;

FUSED_KERNELS(FUSED_INSTANTIATE)
#if __METAL_VERSION__ >= 310
FUSED_KERNELS_BFLOAT(FUSED_INSTANTIATE)
#endif
