// Types shared by every SIMD build of the CPU kernel and by the dispatcher.
#pragma once
#include <cstdint>

namespace mfa {

// Storage tags: half and bfloat16 travel as raw bits; the ISA layer widens them to float.
struct f16 { uint16_t bits; };
struct bf16 { uint16_t bits; };

// The fp32 scalars of one step, in the order of contract.KernelScalars.
struct Scalars {
  float lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, bc1, bc2;
  bool adam_w_mode, maximize;
};

// A contiguous run of elements of one tensor (or the same run of its four tensors).
struct Span {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  int64_t n;
};

// Param/state dtype pairs the kernel is instantiated for.
enum class Combo : int { F32_F32 = 0, F16_F32, F16_F16, BF16_F32, BF16_BF16, Count };

// One kernel per (ISA, combo, math): processes span[0..n) at element offset `begin`.
using SpanFn = void (*)(const Span&, int64_t begin, int64_t end, const Scalars&);

struct IsaTable {
  const char* name;
  SpanFn adam[static_cast<int>(Combo::Count)];
  SpanFn floor[static_cast<int>(Combo::Count)];  // the memory floor: same loop, trivial math
};

}  // namespace mfa
