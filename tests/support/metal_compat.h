// Lets g++ and clang++ (libstdc++ or libc++: Apple's compiler is clang with libc++) compile
// metal/fused_adam.metal as C++17, so the tests run the shipped kernel source on the CPU (the
// "host emulator"). Only what that file uses is provided; nothing here claims to be
// Metal's semantics beyond: IEEE fp32 arithmetic without contraction (build with
// -ffp-contract=off), correctly rounded sqrt and division (metal::precise), and round-to-nearest-even conversions to half and
// bfloat (Metal's default rounding mode for float -> half/bfloat).
#pragma once

// Standard headers first: the address-space macros below would break them.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#define FUSED_ADAM_HOST_EMULATOR 1
#define __METAL_VERSION__ 310

// Address spaces: device memory is plain memory; `constant` is read-only.
#define device
#define thread
#define constant const
// Function qualifier, and the attribute arguments: macros expand inside [[...]], so
// [[buffer(0)]], [[kernel]], [[host_name("x")]] and [[thread_position_in_grid]] become [[]].
#define kernel
#define buffer(n)
#define host_name(name)
#define thread_position_in_grid
// An explicit instantiation may carry no attribute list in clang's C++, not even an empty one.
#define FUSED_KERNEL_ATTRIBUTES(name)

typedef uint32_t uint;
typedef uint64_t ulong;
typedef uint16_t ushort;
typedef uint8_t uchar;

// Metal's bit reinterpretation between types of one size.
template <typename T, typename U>
inline T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs types of one size");
  T t;
  std::memcpy(&t, &u, sizeof t);
  return t;
}

// g++ 12 and clang 19 on x86-64 implement _Float16 with round-to-nearest-even
// conversions from float.
typedef _Float16 half;

// bfloat: the top 16 bits of an fp32. Widening is exact; narrowing rounds to nearest even and
// keeps NaN a (quiet) NaN rather than letting rounding carry it into Inf.
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  explicit bfloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<uint16_t>((u >> 16) | 0x0040u);
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      bits = static_cast<uint16_t>(u >> 16);
    }
  }
  explicit operator float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
};
static_assert(sizeof(bfloat) == 2, "bfloat must be 2 bytes like Metal's");

// One type serves as both the vector and the packed vector: it has its scalar's alignment,
// which is what Metal's packed_T4 guarantees (and all the emulator needs).
template <typename T>
struct vec4 {
  T e[4];
  vec4() = default;
  template <typename U>
  explicit vec4(const vec4<U>& o) {
    for (int k = 0; k < 4; ++k) {
      e[k] = static_cast<T>(static_cast<float>(o.e[k]));
    }
  }
  explicit vec4(T x) {  // splat, as float4(0.0f)
    for (int k = 0; k < 4; ++k) {
      e[k] = x;
    }
  }
  T& operator[](unsigned k) { return e[k]; }
  const T& operator[](unsigned k) const { return e[k]; }
};
static_assert(sizeof(vec4<half>) == 8 && alignof(vec4<half>) == 2, "packed layout");

typedef vec4<float> float4;
typedef vec4<float> packed_float4;
typedef vec4<half> half4;
typedef vec4<half> packed_half4;
typedef vec4<bfloat> bfloat4;
typedef vec4<bfloat> packed_bfloat4;

namespace metal {
// Correctly rounded, as IEEE requires of sqrt (and as Metal's precise sqrt is meant to be).
inline float sqrt(float x) { return std::sqrt(x); }
inline float fabs(float x) { return std::fabs(x); }
// Round to nearest even (Metal's rint); the emulator runs in the default rounding mode.
inline float rint(float x) { return std::rint(x); }
namespace precise {
// metal::precise:: forms: correctly rounded sqrt and division, whatever the math mode.
inline float sqrt(float x) { return std::sqrt(x); }
inline float divide(float x, float y) { return x / y; }
}  // namespace precise
}  // namespace metal
using namespace metal;
