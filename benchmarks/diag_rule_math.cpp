// What separates the one-state rules (Lion, Adagrad) from their memory floor on one machine: the
// shipped span kernel (adam_kernel.h, the AVX-512 build with BF16 as the package builds it) run
// on its own threads, each thread a contiguous share of one flat tensor as in the step, with
// variants of the rule defined here, round by round in rotating order on the same buffers.
//   floor1         the shipped floor (rules.h Floor1Rule: value-keeping)
//   floor1_change  the floor with values that change every step (p + g * c, s + g * c, c != 0):
//                  does the hardware reward the floor's unchanged stores?
//   lion           the shipped LionRule (lr * sign(c) by Vec::signed_lr: 3 vector operations)
//   lion_product   Lion with lr * Vec::sign(c), the form shipped before signed_lr (6 operations;
//                  the same bits)
//   adagrad        the shipped AdagradRule
//   adagrad_ymm    its division and square root on two 256-bit halves (the same bits)
//   adagrad_newton its square root from vrsqrt14ps and Newton steps (sqrt_newton: the same bits,
//                  checked over all 2^32 inputs on every run)
//   adagrad_nodiv  a timing probe, NOT the contract: the division and square root as multiplies
// The outputs in benchmarks/rule_math_*.txt predate signed_lr: their `lion` is lion_product here
// and their `lion_xor` the shipped lion.
// Usage: diag_rule_math N ROUNDS THREADS DTYPE(fp32|bf16) PREFETCH_BYTES
// g++ -O3 -std=c++20 -ffp-contract=off -fno-math-errno -mavx512f -mavx512bf16 -mavx512dq
//     -mavx512vl -mavx512bw -mavx512vbmi -mavx2 -mfma -mf16c -Isrc/cpu -pthread
//     benchmarks/diag_rule_math.cpp -o /tmp/diag_rule_math
#define MFA_ISA_AVX512 1
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "adam_types.h"
#include "q8_tables.h"
namespace mfa {
static int g_prefetch = 1024;
int prefetch_bytes(int, int) { return g_prefetch; }
int far_prefetch_bytes(int, int) { return 0; }  // these runs predate the far prefetch
bool bf16_pairs() { return true; }
bool q8_permute_dequant() { return true; }
namespace isa {
#include "isa_x86.h"
#include "adam_kernel.h"

struct Floor1Change {
  static constexpr int kStates = 1;
  using Scalars = LionScalars;
  using F = Vec::F;
  F c;
  // g * c up to 0.004: a bf16 value near 0.5 changes too (its ulp there is 2^-8).
  explicit Floor1Change(const Scalars&) : c(Vec::set1(4.0f)) {}
  inline void operator()(F& p, F g, F* s) const {
    const F t = g * c;
    s[0] = s[0] + t;
    p = p + t;
  }
};

struct LionProduct : LionRule {
  using LionRule::LionRule;
  inline void operator()(F& p, F g, F* s) const {
    F& m = s[0];
    F c = beta1 * m + omb1 * g;
    p = p * decay;
    p = p - lr * Vec::sign(c);
    m = beta2 * m + omb2 * g;
  }
};

// What the Adagrad variants below share: plain Adagrad's state and scalars (no L2, no maximize:
// the scalars main passes).
struct AdagradVariant {
  static constexpr int kStates = 1;
  using Scalars = AdagradScalars;
  using F = Vec::F;
  F clr, eps;
  explicit AdagradVariant(const Scalars& s) : clr(Vec::set1(s.clr)), eps(Vec::set1(s.eps)) {}
};

struct AdagradYmm : AdagradVariant {
  using AdagradVariant::AdagradVariant;
  static inline F halves(F g, F acc, F eps) {
    const __m256 e = _mm512_castps512_ps256(eps);
    const __m256 lo = _mm256_div_ps(_mm512_castps512_ps256(g),
                                    _mm256_add_ps(_mm256_sqrt_ps(_mm512_castps512_ps256(acc)), e));
    const __m256 hi = _mm256_div_ps(_mm512_extractf32x8_ps(g, 1),
                                    _mm256_add_ps(_mm256_sqrt_ps(_mm512_extractf32x8_ps(acc, 1)), e));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
  }
  inline void operator()(F& p, F g, F* s) const {
    F& acc = s[0];
    acc = acc + g * g;
    p = p - clr * halves(g, acc, eps);
  }
};

#include "diag_sqrt_newton.h"

struct AdagradNewton : AdagradVariant {
  using AdagradVariant::AdagradVariant;
  inline void operator()(F& p, F g, F* s) const {
    F& acc = s[0];
    acc = acc + g * g;
    p = p - clr * (g / (sqrt_newton(acc) + eps));
  }
};

struct AdagradNoDiv : AdagradVariant {
  using AdagradVariant::AdagradVariant;
  inline void operator()(F& p, F g, F* s) const {
    F& acc = s[0];
    acc = acc + g * g;
    p = p - clr * (g * (acc * eps + eps));
  }
};
}  // namespace isa
}  // namespace mfa

using namespace mfa;

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class Rule, class T> SpanFn kernel() { return isa::span_kernel<Rule, T, T>; }

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s N ROUNDS THREADS fp32|bf16 PREFETCH_BYTES\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atoll(argv[1]);
  const int rounds = std::atoi(argv[2]), threads = std::atoi(argv[3]);
  const bool bf = std::strcmp(argv[4], "bf16") == 0;
  g_prefetch = std::atoi(argv[5]);
  const size_t esz = bf ? 2 : 4;
  // 4 KiB pages, as torch's CPU tensors get them by default.
  auto alloc = [](size_t bytes) {
    const size_t a = size_t(2) << 20;
    bytes = (bytes + a - 1) / a * a;
    void* q = std::aligned_alloc(a, bytes);
    madvise(q, bytes, MADV_NOHUGEPAGE);
    return q;
  };
  void* p = alloc(n * esz);
  void* g = alloc(n * esz);
  void* s = alloc(n * esz);
  Span sp{};
  sp.param = p;
  sp.grad = g;
  sp.state[0] = s;
  sp.n = n;
  const LionScalars lion{1e-4f, 0.9f, 0.99f, 0.1f, 0.01f, 0.999999f, 0};
  const AdagradScalars ada{1e-2f, 1e-10f, 0.0f, 0, 0};
  struct Variant { const char* name; SpanFn fn; const void* scalars; };
  std::vector<Variant> vs;
  if (bf) {
    vs = {{"floor1", kernel<isa::Floor1Rule, bf16>(), &lion},
          {"floor1_change", kernel<isa::Floor1Change, bf16>(), &lion},
          {"lion", kernel<isa::LionRule, bf16>(), &lion},
          {"lion_product", kernel<isa::LionProduct, bf16>(), &lion},
          {"adagrad", kernel<isa::AdagradRule, bf16>(), &ada},
          {"adagrad_ymm", kernel<isa::AdagradYmm, bf16>(), &ada},
          {"adagrad_newton", kernel<isa::AdagradNewton, bf16>(), &ada},
          {"adagrad_nodiv", kernel<isa::AdagradNoDiv, bf16>(), &ada}};
  } else {
    vs = {{"floor1", kernel<isa::Floor1Rule, float>(), &lion},
          {"floor1_change", kernel<isa::Floor1Change, float>(), &lion},
          {"lion", kernel<isa::LionRule, float>(), &lion},
          {"lion_product", kernel<isa::LionProduct, float>(), &lion},
          {"adagrad", kernel<isa::AdagradRule, float>(), &ada},
          {"adagrad_ymm", kernel<isa::AdagradYmm, float>(), &ada},
          {"adagrad_newton", kernel<isa::AdagradNewton, float>(), &ada},
          {"adagrad_nodiv", kernel<isa::AdagradNoDiv, float>(), &ada}};
  }
  // The same-bits variants must give the shipped rules' bits, special values included.
  {
    const float sp_vals[] = {0.0f, -0.0f, 1e-3f, -1e-3f, 1e-40f, -1e-40f, __builtin_nanf(""), __builtin_inff(),
                             -__builtin_inff(), 3.0f, -7.5f, 1e30f};
    const int m = 4096;
    std::vector<float> pa(m), ga(m), sa(m);
    for (int i = 0; i < m; ++i) {
      pa[i] = sp_vals[i % 12] + float(i % 5);
      ga[i] = sp_vals[(i / 12) % 12];
      sa[i] = sp_vals[(i / 144) % 12];
    }
    auto run = [&](SpanFn fn, const void* sc, std::vector<float> pp, std::vector<float> ss) {
      Span t{};
      t.param = pp.data(); t.grad = ga.data(); t.state[0] = ss.data(); t.n = m;
      fn(t, 0, m, sc);
      pp.insert(pp.end(), ss.begin(), ss.end());
      return pp;
    };
    auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
    };
    if (!same(run(kernel<isa::LionRule, float>(), &lion, pa, sa), run(kernel<isa::LionProduct, float>(), &lion, pa, sa)))
      { std::printf("lion_product differs from lion\n"); return 4; }
    std::vector<float> sa2(sa);
    for (auto& x : sa2) x = x < 0 ? -x : x;  // an Adagrad sum is never negative
    if (!same(run(kernel<isa::AdagradRule, float>(), &ada, pa, sa2), run(kernel<isa::AdagradYmm, float>(), &ada, pa, sa2)))
      { std::printf("adagrad_ymm differs from adagrad\n"); return 4; }
  }
  {
    const unsigned long long bad = isa::sqrt_newton_mismatches();
    std::printf("# sqrt_newton against vsqrtps, all 2^32 inputs: %llu differ\n", bad);
    if (bad) return 4;
  }
  const int nv = int(vs.size());
  std::barrier sync(threads);
  std::vector<std::vector<double>> secs(static_cast<size_t>(nv));
  for (auto& v : secs) v.assign(size_t(rounds), 0.0);
  auto worker = [&](int t) {
    cpu_set_t cs;
    CPU_ZERO(&cs);
    CPU_SET(t % int(std::thread::hardware_concurrency()), &cs);
    sched_setaffinity(0, sizeof cs, &cs);
    const int64_t b = n * t / threads, e = n * (t + 1) / threads;
    for (int64_t i = b; i < e; ++i) {  // first touch by the owner; Adagrad's sum >= g * g
      const float pv = 0.5f + 1e-3f * float(i % 1000), gv = 1e-3f * float((i * 7919) % 2001 - 1000);
      const float sv = 1e-4f + 1e-6f * float(i % 777);
      if (bf) {
        auto bits = [](float x) { uint32_t u; std::memcpy(&u, &x, 4); return uint16_t(u >> 16); };
        static_cast<uint16_t*>(p)[i] = bits(pv);
        static_cast<uint16_t*>(g)[i] = bits(gv);
        static_cast<uint16_t*>(s)[i] = bits(sv);
      } else {
        static_cast<float*>(p)[i] = pv;
        static_cast<float*>(g)[i] = gv;
        static_cast<float*>(s)[i] = sv;
      }
    }
    for (int r = 0; r < rounds; ++r) {
      for (int k = 0; k < nv; ++k) {
        const Variant& v = vs[size_t((r + k) % nv)];  // rotating order
        sync.arrive_and_wait();
        const double t0 = now();
        v.fn(sp, b, e, v.scalars);
        sync.arrive_and_wait();
        if (t == 0) secs[size_t((r + k) % nv)][size_t(r)] = now() - t0;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker, t);
  for (auto& th : pool) th.join();
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("# %s, %d threads, %lld elements, %d rounds (the first dropped), prefetch %d bytes\n", argv[4],
              threads, (long long)n, rounds, g_prefetch);
  std::printf("| variant | ns/elem | speed vs floor1 (median of round ratios) |\n|---|---|---|\n");
  for (int k = 0; k < nv; ++k) {
    std::vector<double> t(secs[size_t(k)].begin() + 1, secs[size_t(k)].end()), ratio;
    for (int r = 1; r < rounds; ++r) ratio.push_back(secs[0][size_t(r)] / secs[size_t(k)][size_t(r)]);
    std::printf("| %s | %.4f | %.3f |\n", vs[size_t(k)].name, median(t) / double(n) * 1e9, median(ratio));
  }
  return 0;
}
