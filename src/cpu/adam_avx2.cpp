// The avx2 build of the CPU kernel, compiled with its own ISA flags (cmake/cpu_adam.cmake).
#define MFA_ISA_AVX2 1
// System headers first: the ISA layer and the kernel are then included inside a namespace of
// this build's own, so inline code compiled with different -m flags never merges at link time.
#include <immintrin.h>
#include <cstdint>
#include <type_traits>
#include "adam_types.h"
namespace mfa { namespace isa_avx2 {
#include "isa_x86.h"
#include "adam_kernel.h"
IsaTable table() { return make_table("avx2"); }
}}  // namespace mfa::isa_avx2
