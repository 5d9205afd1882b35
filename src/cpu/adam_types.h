// Types shared by every SIMD build of the CPU kernel and by the dispatcher: the list of update
// rules, their host-scalar structs, spans and the per-ISA kernel tables.
#pragma once
#include <cstdint>

namespace mfa {

// How far ahead (bytes) the kernel loop prefetches each stream of a tensor whose params and
// states have these element sizes; 0 leaves it to the hardware prefetchers. Chosen per CPU
// vendor and sizes (dispatch.cpp), unless MPS_FUSED_ADAM_PREFETCH or set_prefetch_bytes() fixed
// one distance for all.
int prefetch_bytes(int param_size, int state_size);
void set_prefetch_bytes(int bytes);  // 0 to 65536, or -1 for the per-vendor choice; else throws
// A second prefetch of each stream, this many bytes ahead, into L2 only (locality hint 1,
// prefetcht2 on x86); 0 for none. Per vendor and sizes (dispatch.cpp) unless
// set_far_prefetch_bytes() fixed one distance.
int far_prefetch_bytes(int param_size, int state_size);
void set_far_prefetch_bytes(int bytes);  // 0 to 1 << 20, or -1 for the per-vendor choice; else throws
// Whether the x86 span loops take bf16 params and states as even and odd lanes (adam_kernel.h);
// on by default. Off only to measure the difference in one process (diag_bf16_pairs.py, docs/experiments.md).
bool bf16_pairs();
void set_bf16_pairs(bool on);
// Whether the 8-bit kernel dequantizes a block by byte permutes where the build has them
// (AVX512_VBMI), instead of a gather per vector; on by default. Off only to measure the difference
// in one process (diag_q8_dequant.py, docs/experiments.md).
bool q8_permute_dequant();
void set_q8_permute_dequant(bool on);

// Storage tags: half and bfloat16 travel as raw bits; the ISA layer widens them to float.
struct f16 { uint16_t bits; };
struct bf16 { uint16_t bits; };
// A bf16 parameter stored by stochastic rounding (lowbit.py's contract): loads as bf16, stores
// from fp32 with the random bits of (Span::sr_key, element index).
struct bf16sr { uint16_t bits; };

// The rules' fp32 host scalars, one struct per rule, fields named and ordered as its
// numerics/contract.py NamedTuple; Python packs them with the rule's struct format and the Metal
// kernels read the same bytes (their Params structs are written from the same source).
// BEGIN scalar structs: written by ci/scalar_structs.py from numerics/contract.py; do not edit
// Adam (contract.AdamScalars).
struct AdamScalars {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float step_size;  // lr / bc1, bc1 = 1 - beta1^step (1 without bias correction)
  float d2;  // 1 / sqrt(bc2), bc2 = 1 - beta2^step (1 without bias correction)
  float decay;  // 1 - lr * wd in AdamW mode, 1 in L2 mode
  uint32_t adam_w_mode;
  uint32_t maximize;
};
static_assert(sizeof(AdamScalars) == 44, "AdamScalars: see Adam (contract.AdamScalars)");
// Lion (contract.LionScalars).
struct LionScalars {
  float lr;
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float decay;  // 1 - lr * weight_decay
  uint32_t maximize;
};
static_assert(sizeof(LionScalars) == 28, "LionScalars: see Lion (contract.LionScalars)");
// Adagrad (contract.AdagradScalars).
struct AdagradScalars {
  float clr;  // lr / (1 + (step - 1) * lr_decay)
  float eps;
  float weight_decay;
  uint32_t l2;  // weight_decay != 0
  uint32_t maximize;
};
static_assert(sizeof(AdagradScalars) == 20, "AdagradScalars: see Adagrad (contract.AdagradScalars)");
// 8-bit Adam on the CPU (contract.Adam8bitScalars).
struct Adam8bitScalars {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float step_size;  // lr / bc1
  float d2;  // 1 / sqrt(bc2)
  float decay;  // 1 - lr * wd in AdamW mode, 1 in L2 mode
  float clip;  // bound of |m / denom| (normalized_step_bound, rounded up)
  uint32_t adam_w_mode;
  uint32_t maximize;
};
static_assert(sizeof(Adam8bitScalars) == 48, "Adam8bitScalars: see 8-bit Adam on the CPU (contract.Adam8bitScalars)");
// END scalar structs

// THE list of update rules: X(enum id, Python name, functor in rules.h, scalar struct, states).
// Adding a rule: one line here, its functor in rules.h, its scalar struct above (written from its
// contract.py NamedTuple by ci/scalar_structs.py); every ISA x dtype pair is
// then instantiated from this list (kernel.h) and bound by name (bindings.cpp). The native parity
// harness (tests/support/native/isa_parity.cpp) runs every rule of this list and needs its example scalars.
// "floor" is the benchmark's memory floor: Adam's access pattern with trivial math, Adam's scalars;
// "floor1" that of the one-state rules (Lion, Adagrad: 3 reads, 2 writes), Lion's scalars.
#define MFA_RULES(X)                                      \
  X(Adam, "adam", AdamRule, AdamScalars, 2)               \
  X(Lion, "lion", LionRule, LionScalars, 1)               \
  X(Adagrad, "adagrad", AdagradRule, AdagradScalars, 1)   \
  X(Floor, "floor", FloorRule, AdamScalars, 2)            \
  X(Floor1, "floor1", Floor1Rule, LionScalars, 1)

enum class RuleId : int {
#define MFA_RULE_ID(id, name, functor, scalars, states) id,
  MFA_RULES(MFA_RULE_ID)
#undef MFA_RULE_ID
  Count
};

constexpr int kMaxStates = 2;  // the most state tensors any rule has

// A contiguous run of elements of one tensor (or the same run of its param, grad and states).
struct Span {
  void* param;
  const void* grad;
  void* state[kMaxStates];  // the first `states` of the rule are used
  int64_t n;
  uint32_t sr_key;  // lowbit.sr_key(seed, step) of this tensor (stochastic-rounding combos only)
};

// Param/state dtype pairs the kernel is instantiated for.
// The _SR pairs store a bf16 param by stochastic rounding (grads and loads are plain bf16).
enum class Combo : int { F32_F32 = 0, F16_F32, F16_F16, BF16_F32, BF16_BF16, BF16SR_F32, BF16SR_BF16, Count };

// One kernel per (ISA, rule, combo): processes span elements [begin, end) with the rule's scalar
// struct at `scalars` (suitably aligned).
using SpanFn = void (*)(const Span&, int64_t begin, int64_t end, const void* scalars);

// ---- 8-bit block-wise Adam (lowbit.py's contract; adam8bit_kernel.h, adam8bit.cpp) ----------

constexpr int64_t kQ8Block = 256;  // elements per block: one fp32 scale (absmax) per moment

// One 8-bit map as the CPU quantizer reads it (lowbit.kernel_table: the code values, and the
// region constants of its nearest-code search, q8_search.h). A map's positive half has midpoints
// M_0..M_N; the count of them below x > 0 is the code's distance from the zero code.
struct Q8Map {
  const float* values;
  const uint8_t* bytes;       // the code values' bits as four 256-byte planes, lowest byte first
  const uint32_t* mid_bits;   // M_0..M_N as fp32 bits
  const float* a;             // per region (0..8, padded to 16): the estimate x * a - c of the count
  const float* c;
  const float* jhi;           // per region: the largest count in it (as fp32)
  const float* jlo;           // per region: the smallest midpoint the correction may test
  const int32_t* region;      // per binade index (q8_binade): the regions below that binade
  const uint32_t* boundary;   // per binade index: the bits of the region boundary in it, or 0x7FFFFFFF
  const uint32_t* boundaries; // the 8 region boundaries' bits, ascending (paths that compare)
  // per binade index: the region of z >= 2^-31 below 2 in one addition, (z + region_add[k]) >> 23
  // (the region's count shifted in, the binade's bottom subtracted, and the distance from the
  // boundary to the binade's top added, so crossing the boundary carries into bit 23)
  const uint32_t* region_add;
  float unsure;  // the estimate's largest error at a midpoint: a fast path rechecks lanes this close to an integer
  uint32_t zero;   // the zero code: 127 (signed) or 0 (unsigned)
  uint32_t top;    // N, the last positive-half midpoint
  uint32_t is_signed;
};

struct Q8Job {
  void* param;
  const void* grad;
  uint8_t* codes1;
  float* absmax1;
  uint8_t* codes2;
  float* absmax2;
  int64_t n;
  Q8Map map1, map2;  // signed (first moment), unsigned (second)
  Adam8bitScalars s;
  uint32_t sr_key;
};

// Blocks [b0, b1) of one job, for one param storage (Q8Param).
using Q8Fn = void (*)(const Q8Job&, int64_t b0, int64_t b1);
enum class Q8Param : int { F32 = 0, F16, BF16, BF16SR, Count };
// Codes of x[0..n) on one map, as the 8-bit step quantizes (the tests' window onto the search).
using Q8QuantizeFn = void (*)(const float* x, int64_t n, const Q8Map& map, bool positive_floor, uint8_t* out);

// ---- 4-bit block-wise Adam (lowbit4.py's contract; adam4bit_kernel.h, adam4bit.cpp) -----------

constexpr int64_t kQ4Block = 128;  // elements per block: one fp32 scale per moment
constexpr int kQ4Table = 32;       // lowbit4.kernel_table4: 16 code values, 15 midpoints, one 0 pad

// One tensor's 4-bit step: codes of elements 2i and 2i+1 share byte i (high nibble = even
// element), ceil(n / 2) bytes per moment. The maps are copied in (checked by adam4bit.cpp).
struct Q4Job {
  void* param;
  const void* grad;
  uint8_t* codes1;
  float* absmax1;
  uint8_t* codes2;
  float* absmax2;
  int64_t n;
  Adam8bitScalars s;  // the 4-bit rule has the 8-bit rule's scalars, clamp included
  uint32_t sr_key;
  alignas(64) float map1[kQ4Table];  // signed (first moment)
  alignas(64) float map2[kQ4Table];  // unsigned, zero-free (second)
};
using Q4Fn = void (*)(const Q4Job&, int64_t b0, int64_t b1);  // blocks [b0, b1) of one job
// Packed codes of x[0..n) on one kernel_table4 map (the tests' window onto the 4-bit search).
using Q4QuantizeFn = void (*)(const float* x, int64_t n, const float* table, uint8_t* out);

struct IsaTable {
  const char* name;
  SpanFn fn[static_cast<int>(RuleId::Count)][static_cast<int>(Combo::Count)];
  Q8Fn adam8bit[static_cast<int>(Q8Param::Count)];
  Q8Fn adam8bit_floor[static_cast<int>(Q8Param::Count)];  // the benchmark's memory floor
  Q8QuantizeFn q8_quantize;  // the 8-bit kernel's nearest-code search alone (tests)
  Q4Fn adam4bit[static_cast<int>(Q8Param::Count)];  // per param storage, as adam8bit
  Q4Fn adam4bit_floor[static_cast<int>(Q8Param::Count)];  // the benchmark's memory floor
  Q4QuantizeFn q4_quantize;  // the 4-bit kernel's nearest-code search alone (tests)
};

}  // namespace mfa

#include "q8_search.h"
