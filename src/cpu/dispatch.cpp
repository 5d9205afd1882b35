#include "dispatch.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

namespace mfa {
namespace isa_scalar { IsaTable table(); }
#if defined(__x86_64__) || defined(_M_X64)
namespace isa_avx2 { IsaTable table(); }
namespace isa_avx512 { IsaTable table(); }
namespace isa_avx512bf16 { IsaTable table(); }
#endif
#if defined(__aarch64__)
namespace isa_neon { IsaTable table(); }
#endif

static std::vector<IsaTable> detect() {
  std::vector<IsaTable> isas;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  bool avx512 = avx2 && __builtin_cpu_supports("avx512f");
  if (avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))
    isas.push_back(isa_avx512bf16::table());
  if (avx512) isas.push_back(isa_avx512::table());
  if (avx2) isas.push_back(isa_avx2::table());
#endif
#if defined(__aarch64__)
  isas.push_back(isa_neon::table());
#endif
  isas.push_back(isa_scalar::table());
  return isas;
}

const std::vector<IsaTable>& supported_isas() {
  static const std::vector<IsaTable> isas = detect();
  return isas;
}

static std::atomic<const IsaTable*> g_active{nullptr};

static const IsaTable* find(const std::string& name) {
  for (const auto& t : supported_isas())
    if (name == t.name) return &t;
  return nullptr;
}

const IsaTable& active_isa() {
  const IsaTable* t = g_active.load();
  if (!t) {
    const char* env = std::getenv("MPS_FUSED_ADAM_SIMD");
    t = (env && *env) ? find(env) : nullptr;
    if (!t) t = &supported_isas().front();
    g_active.store(t);
  }
  return *t;
}

void set_active_isa(const std::string& name) {
  const IsaTable* t = find(name);
  if (!t) {
    std::string choices;
    for (const auto& s : supported_isas()) choices += std::string(choices.empty() ? "" : ", ") + s.name;
    throw std::invalid_argument("SIMD path '" + name + "' is not supported on this CPU; supported: " + choices);
  }
  g_active.store(t);
}

}  // namespace mfa
