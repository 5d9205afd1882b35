// What dispatch.cpp (the per-vendor choice, not linked into the parity programs) answers the span
// loops and the low-bit kernels, fixed, and the two ISA tables a program compares: a fixed
// prefetch distance, so that the loops' prefetch branch runs too (prefetching moves no bit:
// tests/test_cpu_kernel.py checks every distance), the far prefetch past the ends of the tensors
// included, and the bf16 pair path on, as by default (test_cpu_kernel.py checks that turning it
// off moves no bit). Each program defines q8_permute_dequant() itself.
#pragma once

#include "adam_types.h"

namespace mfa {
namespace isa_scalar { IsaTable table(); }
namespace MFA_NATIVE_NS { IsaTable table(); }
int prefetch_bytes(int, int) { return 256; }
int far_prefetch_bytes(int, int) { return 2048; }
bool bf16_pairs() { return true; }
}  // namespace mfa
