// Run-time choice of the SIMD build: x86-64 wheels have an SSE2 baseline, so AVX2 and AVX-512
// are separate builds picked by CPUID, never -march=native.
#pragma once
#include <string>
#include <vector>
#include "adam_types.h"

namespace mfa {

// The builds this CPU can run, best first (the last is always "scalar").
const std::vector<IsaTable>& supported_isas();
// The active build: the best supported one, or MPS_FUSED_ADAM_SIMD's choice at import.
const IsaTable& active_isa();
// Selects a supported build by name; throws std::invalid_argument naming the choices otherwise.
void set_active_isa(const std::string& name);

}  // namespace mfa
