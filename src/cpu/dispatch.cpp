#include "dispatch.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

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
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vbmi"))
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

// Software prefetch, measured per vendor with every distance in one process
// (diag_prefetch.py, docs/experiments.md, prefetch_*.txt): on the 16-core Intel Xeon 512 to 2048 bytes ahead
// beat none in every case (1 KiB kept); on the 2-core AMD EPYC (Zen 4) none was best with fp32
// params (the prefetches only take load slots there), and 512 bytes with 2-byte params (figures:
// docs/benchmarks.md, "Figures behind the code"). Elsewhere (Apple Silicon
// included: untested there) the Xeon's choice stands.
static bool amd_cpu() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_is("amd");
#else
  return false;
#endif
}

static int vendor_prefetch(int param_size, int state_size) {
  static const bool amd = amd_cpu();
  (void)state_size;
  if (!amd) return 1024;
  return param_size == 2 ? 512 : 0;
}

// Digits only, 0 to 65536; anything else keeps the per-vendor choice (backends.py warns).
static int parse_prefetch_env() {
  const char* env = std::getenv("MPS_FUSED_ADAM_PREFETCH");
  if (!env || !*env) return -1;
  long v = 0;
  for (const char* c = env; *c; ++c) {
    if (*c < '0' || *c > '9' || v > 65536) return -1;
    v = v * 10 + (*c - '0');
  }
  return v <= 65536 ? int(v) : -1;
}

static std::atomic<int> g_prefetch{parse_prefetch_env()};  // -1: the per-vendor choice

int prefetch_bytes(int param_size, int state_size) {
  const int fixed = g_prefetch.load(std::memory_order_relaxed);
  return fixed >= 0 ? fixed : vendor_prefetch(param_size, state_size);
}

void set_prefetch_bytes(int bytes) {
  if (bytes < -1 || bytes > 65536)
    throw std::invalid_argument("prefetch distance must be 0 to 65536 bytes (or -1: per vendor), got " +
                                std::to_string(bytes));
  g_prefetch.store(bytes, std::memory_order_relaxed);
}

// The far prefetch, measured on the 16-core Intel Xeon in one process against the near one alone
// (diag_far_prefetch.py, docs/experiments.md, far_prefetch_xeon16.txt): 8 times the near distance ahead, into
// L2, made the cases with fp32 states faster at 1, 4 and 16 threads (Adam fp32 and bf16 params
// with fp32 states, Lion and Adagrad fp32), and mostly their trivial-math floor too; with bf16
// states it moved both ways, so they keep the near prefetch alone. Intel x86 only: on the 2-core
// AMD EPYC it slowed fp32 and moved bf16/bf16 both ways from run to run
// (far_prefetch_2core.txt); Arm was not measured.
static bool far_prefetch_measured() {
#if defined(__x86_64__) || defined(_M_X64)
  return !amd_cpu();
#else
  return false;
#endif
}

static std::atomic<int> g_far_prefetch{-1};  // -1: the per-vendor choice

int far_prefetch_bytes(int param_size, int state_size) {
  const int fixed = g_far_prefetch.load(std::memory_order_relaxed);
  if (fixed >= 0) return fixed;
  static const bool measured = far_prefetch_measured();
  return measured && state_size == 4 ? 8 * prefetch_bytes(param_size, state_size) : 0;
}

void set_far_prefetch_bytes(int bytes) {
  if (bytes < -1 || bytes > (1 << 20))
    throw std::invalid_argument("far prefetch distance must be 0 to 1048576 bytes (or -1: per vendor), got " +
                                std::to_string(bytes));
  g_far_prefetch.store(bytes, std::memory_order_relaxed);
}

static std::atomic<bool> g_bf16_pairs{true};
bool bf16_pairs() { return g_bf16_pairs.load(std::memory_order_relaxed); }
void set_bf16_pairs(bool on) { g_bf16_pairs.store(on, std::memory_order_relaxed); }

static std::atomic<bool> g_q8_permute_dequant{true};
bool q8_permute_dequant() { return g_q8_permute_dequant.load(std::memory_order_relaxed); }
void set_q8_permute_dequant(bool on) { g_q8_permute_dequant.store(on, std::memory_order_relaxed); }

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
