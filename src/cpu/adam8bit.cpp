// 8-bit block-wise Adam (contract: python/mps_fused_adam/lowbit.py, reference_lowbit.py) on the
// CPU, optionally with bf16 stochastic rounding of the parameter.
//
// The block (256 elements, one fp32 scale per moment) is the unit of work: a thread owns whole
// blocks, so the new scale of a block is known before any of its codes is written. Portable
// scalar C++ built with -ffp-contract=off (one build serves every SIMD path, so the result is the
// same on all of them); every operation is the reference's, in its order.
#include <nanobind/nanobind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "adam_types.h"
#include "thread_pool.h"

namespace mfa {
namespace a8 {
#include "isa_scalar.h"  // Vec: scalar loads and stores of float, f16 and bf16 (round to nearest even)
}  // namespace a8

namespace {

namespace nb = nanobind;
using a8::Vec;

constexpr int64_t kBlock = 256;
constexpr int kCodes = 256;

// lowbit.Adam8bitScalars: contract v2's Adam scalars with the clamp after `decay` ("<10f2I").
struct Adam8bitScalars {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, step_size, d2, decay, clip;
  uint32_t adam_w_mode, maximize;
};
static_assert(sizeof(Adam8bitScalars) == 48, "must match lowbit.ADAM8BIT_STRUCT");

struct Job {
  void* param;
  const void* grad;
  uint8_t* codes1;
  float* absmax1;
  uint8_t* codes2;
  float* absmax2;
  int64_t n;
  const float* map1;  // 256 code values (signed map), then 255 midpoints
  const float* mid1;
  const float* start1;
  const float* map2;
  const float* mid2;
  const float* start2;
  Adam8bitScalars s;
  uint32_t sr_key;
  bool sr;
  int64_t blocks;
  int threads;
};

inline uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

// lowbit.sr_bits_int: 16 random bits of element `index` under `key`.
inline uint32_t sr_bits(uint32_t key, uint64_t index) {
  uint32_t x = key ^ (uint32_t(index) * 0x9E3779B9u) ^ (uint32_t(index >> 32) * 0x85EBCA77u);
  return fmix32(x) >> 16;
}

inline void store_param(float* p, float x, const Job&, int64_t) { *p = x; }
inline void store_param(f16* p, float x, const Job&, int64_t) { Vec::store(p, x); }
inline void store_param(bf16* p, float x, const Job& job, int64_t i) {
  if (!job.sr) {
    Vec::store(p, x);
    return;
  }
  // Stochastic rounding: add 16 random bits below the kept ones and truncate (unbiased).
  uint32_t u;
  std::memcpy(&u, &x, 4);
  p->bits = std::isnan(x) ? uint16_t(0x7FC0) : uint16_t((u + sr_bits(job.sr_key, uint64_t(i))) >> 16);
}

// The number of midpoints strictly below x: the nearest code, ties to the lower one, NaN -> 0.
// `start` (lowbit.kernel_table) holds, per 2^20 fp32 bit patterns in value order, the count of
// midpoints below the whole bucket; a few steps up from there find x's count.
inline uint32_t code_of(float x, const float* mid, const float* start) {
  if (x != x) return 0;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  uint32_t c = uint32_t(start[key >> 20]);
  while (c < kCodes - 1 && mid[c] < x) ++c;
  return c;
}

// max(|x|) that turns NaN once any element is NaN (as torch's amax does).
inline float nan_max(float acc, float a) { return (a > acc || a != a) && acc == acc ? a : acc; }

template <class P>
void run_block(const Job& job, int64_t b) {
  const Adam8bitScalars& s = job.s;
  P* param = static_cast<P*>(job.param);
  const P* grad = static_cast<const P*>(job.grad);
  const int64_t lo = b * kBlock, hi = std::min(job.n, lo + kBlock);
  const float a1 = job.absmax1[b], a2 = job.absmax2[b];
  float mb[kBlock], vb[kBlock];
  float mx1 = 0.0f, mx2 = 0.0f;
  for (int64_t i = lo; i < hi; ++i) {
    float p = Vec::load(param + i), g = Vec::load(grad + i);
    float m = job.map1[job.codes1[i]] * a1;
    float v = job.map2[job.codes2[i]] * a2;
    if (s.maximize) g = -g;
    if (!s.adam_w_mode) g = g + s.weight_decay * p;
    m = s.beta1 * m + s.one_minus_beta1 * g;
    v = s.beta2 * v + s.one_minus_beta2 * (g * g);
    float denom = std::sqrt(v) * s.d2 + s.eps;
    float u = m / denom;
    if (u > s.clip) u = s.clip;
    if (u < -s.clip) u = -s.clip;
    if (s.adam_w_mode) p = p * s.decay;
    p = p - s.step_size * u;
    store_param(param + i, p, job, i);
    mb[i - lo] = m;
    vb[i - lo] = v;
    mx1 = nan_max(mx1, std::fabs(m));
    mx2 = nan_max(mx2, std::fabs(v));
  }
  const float inv1 = mx1 == 0.0f ? 0.0f : 1.0f / mx1;
  const float inv2 = mx2 == 0.0f ? 0.0f : 1.0f / mx2;
  for (int64_t i = lo; i < hi; ++i) {
    job.codes1[i] = uint8_t(code_of(mb[i - lo] * inv1, job.mid1, job.start1));
    const float x2 = vb[i - lo] * inv2;
    uint32_t c2 = code_of(x2, job.mid2, job.start2);
    if (c2 == 0 && x2 > 0.0f) c2 = 1;  // a positive second moment is never stored as zero
    job.codes2[i] = uint8_t(c2);
  }
  job.absmax1[b] = mx1;
  job.absmax2[b] = mx2;
}

template <class P>
void run_range(void* ctx, int t) {
  const Job& job = *static_cast<const Job*>(ctx);
  // Whole blocks per thread: [blocks * t / T, blocks * (t + 1) / T).
  const int64_t b0 = job.blocks * t / job.threads, b1 = job.blocks * (t + 1) / job.threads;
  for (int64_t b = b0; b < b1; ++b) run_block<P>(job, b);
}

template <class T>
T* ptr(uintptr_t a) {
  return reinterpret_cast<T*>(a);
}

void adam8bit_step(uintptr_t param, uintptr_t grad, uintptr_t codes1, uintptr_t absmax1, uintptr_t codes2,
                   uintptr_t absmax2, int64_t n, int param_dtype, uintptr_t map1, uintptr_t map2,
                   nb::bytes scalars, uint32_t sr_key, bool sr, int num_threads) {
  if (n < 0) throw std::invalid_argument("negative element count");
  if (scalars.size() != sizeof(Adam8bitScalars))
    throw std::invalid_argument("adam8bit takes a " + std::to_string(sizeof(Adam8bitScalars)) +
                                "-byte scalar struct; got " + std::to_string(scalars.size()));
  if (param_dtype < 0 || param_dtype > 2)
    throw std::invalid_argument("param dtype code must be 0 (float32), 1 (float16) or 2 (bfloat16)");
  Job job{};
  job.param = ptr<void>(param);
  job.grad = ptr<const void>(grad);
  job.codes1 = ptr<uint8_t>(codes1);
  job.absmax1 = ptr<float>(absmax1);
  job.codes2 = ptr<uint8_t>(codes2);
  job.absmax2 = ptr<float>(absmax2);
  job.n = n;
  job.map1 = ptr<const float>(map1);
  job.mid1 = job.map1 + kCodes;
  job.start1 = job.map1 + 2 * kCodes;
  job.map2 = ptr<const float>(map2);
  job.mid2 = job.map2 + kCodes;
  job.start2 = job.map2 + 2 * kCodes;
  std::memcpy(&job.s, scalars.c_str(), sizeof job.s);
  job.sr_key = sr_key;
  job.sr = sr && param_dtype == 2;
  job.blocks = (n + kBlock - 1) / kBlock;
  if (job.blocks == 0) return;
  // Below 128 blocks (32K elements) per thread, waking another costs more than it saves.
  job.threads = int(std::max<int64_t>(1, std::min<int64_t>(std::max(num_threads, 1), job.blocks / 128)));
  ThreadPool::Task task = param_dtype == 0 ? run_range<float> : param_dtype == 1 ? run_range<f16> : run_range<bf16>;
  nb::gil_scoped_release release;
  ThreadPool::instance().run(job.threads, task, &job);
}

}  // namespace

void register_adam8bit(nb::module_& m) {
  m.def("adam8bit_step", &adam8bit_step, nb::arg("param"), nb::arg("grad"), nb::arg("codes1"),
        nb::arg("absmax1"), nb::arg("codes2"), nb::arg("absmax2"), nb::arg("n"), nb::arg("param_dtype"),
        nb::arg("map1"), nb::arg("map2"), nb::arg("scalars"), nb::arg("sr_key"), nb::arg("sr"),
        nb::arg("num_threads"),
        "One 8-bit block-wise Adam step over one contiguous tensor given as host addresses: codes\n"
        "(uint8) and block scales (fp32) of both moments; map1/map2 hold the 256 code values followed\n"
        "by the 255 midpoints, a pad and the start counts (lowbit.kernel_table); scalars is lowbit.pack_adam8bit(hyper); with sr,\n"
        "a bf16 param is stored by stochastic rounding with sr_key. Releases the GIL.");
}

}  // namespace mfa
