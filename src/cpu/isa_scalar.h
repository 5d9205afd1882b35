// Scalar layer: one float at a time, half and bfloat16 converted in software so the baseline
// build (SSE2 on x86-64) needs no F16C; results match the vector layers bit for bit.
#pragma once

// (included by adam_<isa>.cpp inside its namespace, after the system headers)

struct Vec {
  static constexpr int W = 1;
  using F = float;
  static constexpr bool kBf16Pairs = false;  // no pair path (adam_kernel.h): not measured here
  static F set1(float x) { return x; }
  static F sqrt(F x) { return std::sqrt(x); }
  static F neg(F x) { return -x; }
  // Lion's sign: 1 for x > 0, -1 for x < 0, else x - x (+0 for both zeros, NaN for NaN).
  static F sign(F x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x - x); }
  static F signed_lr(F lr, F x) { return lr * sign(x); }  // the definition the vector layers follow
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }

  static uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
  static float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

  static F load(const bf16* p) { return from_bits(uint32_t(p->bits) << 16); }
  static void store(bf16* p, F x) {
    uint32_t u = bits(x);
    p->bits = std::isnan(x) ? uint16_t(0x7FC0) : uint16_t((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16);
  }

  static F load(const f16* p) {
    uint32_t h = p->bits, sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in float
      float mag = float(mant) * 5.9604644775390625e-8f;
      return from_bits(bits(mag) | sign);
    }
    if (exp == 31) return from_bits(sign | 0x7F800000u | (mant << 13));
    return from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
  }
  static void store(f16* p, F x) {
    // Round to nearest even, as F16C's vcvtps2ph and NEON's vcvt do.
    uint32_t u = bits(x), sign = (u >> 16) & 0x8000u;
    u &= 0x7FFFFFFFu;
    uint32_t h;
    if (u >= 0x7F800000u) {
      h = u > 0x7F800000u ? (0x7E00u | ((u >> 13) & 0x3FFu)) : 0x7C00u;  // NaN stays quiet NaN
    } else if (u >= 0x477FF000u) {
      h = 0x7C00u;  // rounds past 65504: infinity
    } else if (u < 0x38800000u) {
      // Below half's normal range: adding 0.5f lines the half subnormal ulp (2^-24) up with
      // float's ulp at 0.5, so the FPU's own round-to-nearest-even does the rounding.
      h = bits(from_bits(u) + 0.5f) - 0x3F000000u;
    } else {
      uint32_t odd = (u >> 13) & 1u;
      h = (u + 0xC8000FFFu + odd) >> 13;  // rebias exponent by -112, round to nearest even
    }
    p->bits = uint16_t(sign | h);
  }
};
