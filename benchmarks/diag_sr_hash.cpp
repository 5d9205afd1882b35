// What stochastic rounding's random bits cost in the bf16 Adam step (bf16 params and states, the
// avx512bf16 pair path of src/cpu/adam_kernel.h), 1 thread, against round to nearest, with the
// contract's hash (fmix32 of the index product) and with stand-ins that do NOT follow the
// contract, to bound what any hash could save (each keeps the kernel's index products, rounding
// and packing; only the mixing step differs):
//   none     no mixing at all (the key xor the index product): what the rounding costs without a hash
//            (adding the random bits, NaN lanes, packing the pair)
//   onemul   fmix32's first shift, xor and multiply only
//   aes2     two AES rounds (vaesenc) per 16 lanes in place of fmix32
// "fmix32, byte shuffles" is the contract's bits with the kernel's shifts by 16 done as byte
// shuffles. Built from commit 99a63d6's src/cpu (before fmix32's first step was folded into
// the key and NaN lanes into the add's mask), the same harness measures the kernel's earlier code.
// Every variant runs the kernel's real span loop (span_kernel) on the same huge-page buffers,
// alternating with round to nearest, and prints the median of the per-round ratios. The stand-ins
// change the bits; they are timing probes, not candidates (README: stochastic rounding).
// g++ -O3 -std=c++17 -ffp-contract=off -fno-math-errno -mavx512f -mavx512bw -mavx512dq -mavx512vl \
//   -mavx512bf16 -mavx512vbmi -mavx2 -mfma -mf16c -mvaes -maes -Isrc/cpu \
//   benchmarks/diag_sr_hash.cpp -o /tmp/sr_hash && /tmp/sr_hash
#define MFA_ISA_AVX512 1
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "adam_types.h"
namespace mfa {
int prefetch_bytes(int, int) { return 512; }  // the kernel's choice for bf16 on AMD (dispatch.cpp)
int far_prefetch_bytes(int, int) { return 0; }  // off for bf16 states, as the package chooses
bool bf16_pairs() { return true; }
bool q8_permute_dequant() { return true; }
namespace isa {
#include "isa_x86.h"
#include "adam_kernel.h"

enum class Mix { None, OneMul, Aes2, Shuffles };
template <Mix M> struct Probe { uint16_t bits; };
template <Mix M> __m512i mix(__m512i h) {
  if constexpr (M == Mix::OneMul) {
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    return _mm512_mullo_epi32(h, _mm512_set1_epi32(int(0x85EBCA6Bu)));
  } else if constexpr (M == Mix::Aes2) {
    const __m512i k = _mm512_set1_epi32(0x3C6EF372);
    return _mm512_aesenc_epi128(_mm512_aesenc_epi128(h, k), k);
  }
  return h;
}
// ParamStorage<bf16sr>::store_pair with the mixer swapped (the index products as there).
template <Mix M> struct ParamStorage<Probe<M>> {
  using T = bf16;
  using SR = ParamStorage<bf16sr>;
  template <class V = Vec>
  static inline void store_pair(T* dst, __m512 even, __m512 odd, uint32_t key, int64_t index) {
    const uint32_t lo0 = uint32_t(uint64_t(index));
    const __m512i k = _mm512_set1_epi32(int(key));
    const __m512i base = _mm512_add_epi32(_mm512_set1_epi32(int(lo0 * 0x9E3779B9u)), SR::lane_products(2));
    const __m512i he = mix<M>(_mm512_xor_si512(k, base));
    const __m512i ho = mix<M>(_mm512_xor_si512(k, _mm512_add_epi32(base, _mm512_set1_epi32(int(0x9E3779B9u)))));
    const __m512i re = _mm512_srli_epi32(SR::add_random(even, he), 16);
    _mm512_storeu_si512(dst, _mm512_mask_blend_epi16(0x55555555u, SR::add_random(odd, ho), re));
  }
  static inline void store(T* dst, __m512 x, uint32_t key, int64_t index) { SR::store(dst, x, key, index); }
};

// Shuffles: the contract's bits as the kernel computes them, with every ">> 16" a byte shuffle
// (vpshufb) instead of a shift: on Intel, 512-bit shifts and multiplies issue on port 0 only and
// shuffles on port 5. Measured, not adopted (README: stochastic rounding).
static inline __m512i hi16(__m512i x) {
  return _mm512_shuffle_epi8(x, _mm512_set4_epi32(int(0x80800F0Eu), int(0x80800B0Au), int(0x80800706u),
                                                  int(0x80800302u)));
}
static inline __m512i add_random_shuffled(__m512 x, __m512i h) {
  return _mm512_mask_add_epi32(_mm512_set1_epi32(0x7FC00000), _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q),
                               _mm512_castps_si512(x), hi16(h));
}
// fmix32 of k ^ b without its last step, given folded = k ^ (k >> 16) (as the kernel computes it;
// written out here so that the harness also builds against the kernel's earlier code).
static inline __m512i fmix_keyed_shuffled(__m512i folded, __m512i b) {
  __m512i h = _mm512_ternarylogic_epi32(folded, b, hi16(b), 0x96);
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(int(0x85EBCA6Bu)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  return _mm512_mullo_epi32(h, _mm512_set1_epi32(int(0xC2B2AE35u)));
}
template <> struct ParamStorage<Probe<Mix::Shuffles>> {
  using T = bf16;
  using SR = ParamStorage<bf16sr>;
  template <class V = Vec>
  static inline void store_pair(T* dst, __m512 even, __m512 odd, uint32_t key, int64_t index) {
    const uint32_t lo0 = uint32_t(uint64_t(index));
    if (lo0 > 0xFFFFFFFFu - 31u) return SR::store_pair(dst, even, odd, key, index);  // as the kernel
    const uint32_t kk = key ^ (uint32_t(uint64_t(index) >> 32) * 0x85EBCA77u);
    const __m512i k = _mm512_set1_epi32(int(kk ^ (kk >> 16)));
    const __m512i base = _mm512_add_epi32(_mm512_set1_epi32(int(lo0 * 0x9E3779B9u)), SR::lane_products(2));
    const __m512i he = fmix_keyed_shuffled(k, base);
    const __m512i ho = fmix_keyed_shuffled(k, _mm512_add_epi32(base, _mm512_set1_epi32(int(0x9E3779B9u))));
    const __m512i re = hi16(add_random_shuffled(even, he));
    _mm512_storeu_si512(dst, _mm512_mask_blend_epi16(0x55555555u, add_random_shuffled(odd, ho), re));
  }
  static inline void store(T* dst, __m512 x, uint32_t key, int64_t index) { SR::store(dst, x, key, index); }
};
}  // namespace isa
}  // namespace mfa

using namespace mfa;
using Kernel = void (*)(const Span&, int64_t, int64_t, const void*);

static uint16_t* huge(int64_t n) {
  const size_t align = size_t(2) << 20, bytes = (size_t(n) * 2 + align - 1) / align * align;
  auto* q = static_cast<uint16_t*>(std::aligned_alloc(align, bytes));
  madvise(q, bytes, MADV_HUGEPAGE);  // as torch's allocator does for large tensors
  return q;
}
static uint16_t bf16_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);
}

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : int64_t(1) << 24;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 15;
  uint16_t *p = huge(n), *g = huge(n), *m = huge(n), *v = huge(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = bf16_of(0.5f + 1e-3f * float(i % 1000));
    g[i] = bf16_of(1e-5f * float((i * 7919) % 2001 - 1000));
    m[i] = v[i] = 0;
  }
  const AdamScalars sc{0.9f, 0.999f, 0.1f, 0.001f, 1e-8f, 0.01f, 1e-3f, 1.0f, 0.99999f, 1, 0};
  Span sp{};
  sp.param = p;
  sp.grad = g;
  sp.state[0] = m;
  sp.state[1] = v;
  sp.n = n;
  sp.sr_key = 0x2545F491u;
  const struct { const char* name; Kernel fn; } sr[] = {
      {"fmix32 (the contract)", isa::span_kernel<isa::AdamRule, bf16sr, bf16>},
      {"fmix32, byte shuffles", isa::span_kernel<isa::AdamRule, isa::Probe<isa::Mix::Shuffles>, bf16>},
      {"none (no hash)", isa::span_kernel<isa::AdamRule, isa::Probe<isa::Mix::None>, bf16>},
      {"onemul", isa::span_kernel<isa::AdamRule, isa::Probe<isa::Mix::OneMul>, bf16>},
      {"aes2", isa::span_kernel<isa::AdamRule, isa::Probe<isa::Mix::Aes2>, bf16>},
  };
  const Kernel rtn = isa::span_kernel<isa::AdamRule, bf16, bf16>;
  auto time = [&](Kernel fn) {
    const auto t0 = std::chrono::steady_clock::now();
    fn(sp, 0, n, &sc);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / double(n) * 1e9;
  };
  std::printf("bf16 Adam step, %lld elements, 1 thread, %d rounds; ns per element (median) and the median "
              "of the round-by-round ratios to round to nearest\n", static_cast<long long>(n), rounds);
  for (const auto& c : sr) {
    std::vector<double> t_rtn, t_sr, ratio;
    for (int r = 0; r < rounds; ++r) {
      t_rtn.push_back(time(rtn));
      t_sr.push_back(time(c.fn));
      ratio.push_back(t_sr.back() / t_rtn.back());
    }
    auto median = [](std::vector<double> x) {
      std::sort(x.begin(), x.end());
      return x[x.size() / 2];
    };
    std::printf("%-24s round to nearest %.3f  stochastic %.3f  %+.1f%%\n", c.name, median(t_rtn), median(t_sr),
                (median(ratio) - 1) * 100);
  }
}
