// The scalar build of the CPU kernel, compiled with its own ISA flags (cmake/cpu_adam.cmake).

// System headers first: the ISA layer and the kernel are then included inside a namespace of
// this build's own, so inline code compiled with different -m flags never merges at link time.
#include <cmath>
#include <cstring>
#include <cstdint>
#include <type_traits>
#include "adam_types.h"
namespace mfa { namespace isa_scalar {
#include "isa_scalar.h"
#include "adam_kernel.h"
IsaTable table() { return make_table("scalar"); }
}}  // namespace mfa::isa_scalar
