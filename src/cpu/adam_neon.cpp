// The neon build of the CPU kernel, compiled with its own ISA flags (cmake/cpu_adam.cmake).
#define MFA_ISA_NEON 1

// System headers first: the ISA layer and the kernel are then included inside a namespace of
// this build's own, so inline code compiled with different -m flags never merges at link time.
#include <arm_neon.h>
#include <cstdint>
#include <type_traits>
#include "adam_types.h"
namespace mfa { namespace isa_neon {
#include "isa_neon.h"
#include "adam_kernel.h"
IsaTable table() { return make_table("neon"); }
}}  // namespace mfa::isa_neon
