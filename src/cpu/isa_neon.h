// arm64 vector layer (NEON is part of the aarch64 baseline, so no run-time check is needed).
#pragma once

// (included by adam_<isa>.cpp inside its namespace, after the system headers)

struct Vec {
  static constexpr int W = 4;
  using F = float32x4_t;
  static constexpr bool kBf16Pairs = false;  // no pair path (adam_kernel.h): not measured here
  static F set1(float x) { return vdupq_n_f32(x); }
  static F sqrt(F x) { return vsqrtq_f32(x); }
  static F neg(F x) { return vnegq_f32(x); }
  // Lion's sign: 1 where x > 0, -1 where x < 0, else x - x (+0 for both zeros, NaN for NaN).
  static F sign(F x) {
    const F zero = vdupq_n_f32(0.0f);
    F s = vsubq_f32(x, x);
    s = vbslq_f32(vcgtq_f32(x, zero), vdupq_n_f32(1.0f), s);
    return vbslq_f32(vcltq_f32(x, zero), vdupq_n_f32(-1.0f), s);
  }
  // lr * sign(x) for an lr whose sign bit is clear, in the same bits: lr with x's sign bit where
  // |x| > 0 (false for zeros and NaN), else x - x (+0 = lr * +0; NaN).
  static F signed_lr(F lr, F x) {
    const uint32x4_t sign = vdupq_n_u32(0x80000000u);
    const F bits = vbslq_f32(sign, x, lr);
    return vbslq_f32(vcagtq_f32(x, vdupq_n_f32(0.0f)), bits, vsubq_f32(x, x));
  }
  static F load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, F x) { vst1q_f32(p, x); }
  static F load(const f16* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
  }
  static void store(f16* p, F x) {
    vst1_u16(reinterpret_cast<uint16_t*>(p), vreinterpret_u16_f16(vcvt_f16_f32(x)));
  }
  static F load(const bf16* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
  }
  static void store(bf16* p, F x) {
    uint32x4_t u = vreinterpretq_u32_f32(x);
    uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7FFF)));
    uint32x4_t is_num = vceqq_f32(x, x);
    r = vbslq_u32(is_num, r, vdupq_n_u32(0x7FC00000u));
    vst1_u16(reinterpret_cast<uint16_t*>(p), vshrn_n_u32(r, 16));
  }
};
