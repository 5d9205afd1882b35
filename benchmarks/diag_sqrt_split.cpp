// Where the divider binds (Adam and Adagrad, one sqrt and one division per element under the
// contract): does a correctly rounded square root from vrsqrt14ps and fused multiply-adds, on the
// FMA ports, beat vsqrtps on the divider? The same bits either way (checked here over all 2^32
// inputs and on special values through whole rule steps), so this is a choice of instructions,
// not of the contract. Variants, on the same buffers, rounds interleaved:
//   floor   the rule's access pattern with value-keeping math (rules.h FloorRule / Floor1Rule)
//   hw      the shipped rule: vsqrtps for every vector
//   newton  sqrt_newton for every vector
//   split   vsqrtps for the first vector of each pair, sqrt_newton for the second, so the divider
//           and the FMA ports share the work
// The loop is the package's span loop at U = 2 (the bf16 pair path for bf16, near prefetch 1 KiB,
// far prefetch 8 KiB for fp32 as the package chooses on Intel), written out here so that the two
// vectors of a pair can take different rules.
// Usage: diag_sqrt_split N ROUNDS THREADS fp32|bf16 adam|adagrad
// g++ -O3 -std=c++20 -ffp-contract=off -fno-math-errno -mavx512f -mavx512bf16 -mavx512dq
//     -mavx512vl -mavx512bw -mavx2 -mfma -mf16c -Isrc/cpu -pthread
//     benchmarks/diag_sqrt_split.cpp -o /tmp/diag_sqrt_split
#define MFA_ISA_AVX512 1
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "adam_types.h"
namespace mfa {
namespace isa {
#include "isa_x86.h"
#include "rules.h"

#include "diag_sqrt_newton.h"

// The shipped rules' math with the square root swapped (rules.h, same operation order).
struct AdamNewton : AdamRule {
  using AdamRule::AdamRule;
  inline void operator()(F& p, F g, F* s) const {
    F& m = s[0];
    F& v = s[1];
    if (maximize) g = Vec::neg(g);
    if (!adam_w_mode) g = g + wd * p;
    m = beta1 * m + omb1 * g;
    v = beta2 * v + omb2 * (g * g);
    F denom = sqrt_newton(v) * d2 + eps;
    if (adam_w_mode) p = p * decay;
    p = p - step_size * (m / denom);
  }
};
struct AdagradNewton : AdagradRule {
  using AdagradRule::AdagradRule;
  inline void operator()(F& p, F g, F* s) const {
    F& acc = s[0];
    if (maximize) g = Vec::neg(g);
    if (l2) g = g + wd * p;
    acc = acc + g * g;
    p = p - clr * (g / (sqrt_newton(acc) + eps));
  }
};

using F = Vec::F;
// The span loop at U = 2 with rule A on the first vector of each pair and rule B on the second.
template <class A, class B, class T, int K>
void span2(T* p, const T* g, T* const* st, int64_t begin, int64_t end, const void* sc) {
  const A ra(*static_cast<const typename A::Scalars*>(sc));
  const B rb(*static_cast<const typename B::Scalars*>(sc));
  constexpr int W = Vec::W;
  const int64_t ahead = 1024 / int64_t(sizeof(T)), far = std::is_same<T, float>::value ? 8192 / 4 : 0;
  for (int64_t i = begin; i + 2 * W <= end; i += 2 * W) {
    for (int u = 0; u < 2; ++u) {
      __builtin_prefetch(p + i + u * W + ahead, 1);
      __builtin_prefetch(g + i + u * W + ahead, 0);
      for (int k = 0; k < K; ++k) __builtin_prefetch(st[k] + i + u * W + ahead, 1);
    }
    if (far) {
      for (int u = 0; u < 2; ++u) {
        __builtin_prefetch(p + i + u * W + far, 1, 1);
        __builtin_prefetch(g + i + u * W + far, 0, 1);
        for (int k = 0; k < K; ++k) __builtin_prefetch(st[k] + i + u * W + far, 1, 1);
      }
    }
    F pv[2], gv[2], sv[2][K];
    if constexpr (std::is_same<T, bf16>::value) {
      Vec::load_pair(p + i, pv[0], pv[1]);
      Vec::load_pair(g + i, gv[0], gv[1]);
      for (int k = 0; k < K; ++k) Vec::load_pair(st[k] + i, sv[0][k], sv[1][k]);
    } else {
      for (int u = 0; u < 2; ++u) {
        pv[u] = Vec::load(p + i + u * W);
        gv[u] = Vec::load(g + i + u * W);
        for (int k = 0; k < K; ++k) sv[u][k] = Vec::load(st[k] + i + u * W);
      }
    }
    ra(pv[0], gv[0], sv[0]);
    rb(pv[1], gv[1], sv[1]);
    if constexpr (std::is_same<T, bf16>::value) {
      Vec::store_pair(p + i, pv[0], pv[1]);
      for (int k = 0; k < K; ++k) Vec::store_pair(st[k] + i, sv[0][k], sv[1][k]);
    } else {
      for (int u = 0; u < 2; ++u) {
        Vec::store(p + i + u * W, pv[u]);
        for (int k = 0; k < K; ++k) Vec::store(st[k] + i + u * W, sv[u][k]);
      }
    }
  }
}
}  // namespace isa
}  // namespace mfa

using namespace mfa;
using Fn = void (*)(void*, const void*, void* const*, int64_t, int64_t, const void*);
template <class A, class B, class T, int K> Fn fn() {
  return [](void* p, const void* g, void* const* st, int64_t b, int64_t e, const void* sc) {
    isa::span2<A, B, T, K>(static_cast<T*>(p), static_cast<const T*>(g), reinterpret_cast<T* const*>(st), b, e, sc);
  };
}

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class T> static std::vector<std::pair<const char*, Fn>> variants(bool adam) {
  using namespace isa;
  if (adam)
    return {{"floor", fn<FloorRule, FloorRule, T, 2>()},
            {"hw", fn<AdamRule, AdamRule, T, 2>()},
            {"newton", fn<AdamNewton, AdamNewton, T, 2>()},
            {"split", fn<AdamRule, AdamNewton, T, 2>()}};
  return {{"floor", fn<Floor1Rule, Floor1Rule, T, 1>()},
          {"hw", fn<AdagradRule, AdagradRule, T, 1>()},
          {"newton", fn<AdagradNewton, AdagradNewton, T, 1>()},
          {"split", fn<AdagradRule, AdagradNewton, T, 1>()}};
}

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s N ROUNDS THREADS fp32|bf16 adam|adagrad\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atoll(argv[1]) / 64 * 64;
  const int rounds = std::atoi(argv[2]), threads = std::atoi(argv[3]);
  const bool bf = std::strcmp(argv[4], "bf16") == 0, adam = std::strcmp(argv[5], "adam") == 0;
  const int K = adam ? 2 : 1;
  const size_t esz = bf ? 2 : 4;
  auto alloc = [](size_t bytes) {  // 4 KiB pages, as torch's CPU tensors get them by default
    const size_t a = size_t(2) << 20;
    bytes = (bytes + a - 1) / a * a;
    void* q = std::aligned_alloc(a, bytes);
    madvise(q, bytes, MADV_NOHUGEPAGE);
    return q;
  };
  void* p = alloc(n * esz);
  void* g = alloc(n * esz);
  void* st[2] = {alloc(n * esz), adam ? alloc(n * esz) : nullptr};
  // Adam: lr 1e-3, betas (0.9, 0.999), eps 1e-8, AdamW decay 0.01 at step 10; Adagrad: lr 1e-2.
  const double bc1 = 1 - 0.3486784401, bc2 = 1 - 0.990044880209748;
  const AdamScalars as{0.9f, 0.999f, 0.1f, 0.001f, 1e-8f, 0.01f, float(1e-3 / bc1), float(1 / std::sqrt(bc2)),
                       float(1 - 1e-5), 1, 0};
  const AdagradScalars gs{1e-2f, 1e-10f, 0.0f, 0, 0};
  const void* sc = adam ? static_cast<const void*>(&as) : static_cast<const void*>(&gs);
  auto vs = bf ? variants<bf16>(adam) : variants<float>(adam);
  {
    // Same bits: whole rule steps on special values (fp32 storage), then sqrt over all inputs.
    const float sp_vals[] = {0.0f, -0.0f, 1e-3f, -1e-3f, 1e-40f, -1e-40f, __builtin_nanf(""), __builtin_inff(),
                             -__builtin_inff(), 3.0f, -7.5f, 1e30f};
    const int m = 12 * 12 * 12 * 4;
    std::vector<float> pa(m), ga(m), s0(m), s1(m);
    for (int i = 0; i < m; ++i) {
      pa[i] = sp_vals[i % 12] + float(i % 5);
      ga[i] = sp_vals[(i / 12) % 12];
      s0[i] = sp_vals[(i / 144) % 12];
      s1[i] = std::fabs(sp_vals[(i / 1728 + i) % 12]);  // a second moment or sum is never negative
    }
    if (!adam) s0 = s1;
    auto run = [&](Fn f) {
      std::vector<float> pp(pa), a(s0), b(s1);
      void* sts[2] = {a.data(), b.data()};
      f(pp.data(), ga.data(), sts, 0, m, sc);
      pp.insert(pp.end(), a.begin(), a.end());
      pp.insert(pp.end(), b.begin(), b.end());
      return pp;
    };
    auto fv = variants<float>(adam);
    const auto ref = run(fv[1].second);
    for (int k = 2; k < 4; ++k)
      if (std::memcmp(ref.data(), run(fv[k].second).data(), ref.size() * 4) != 0) {
        std::printf("%s differs from hw\n", fv[k].first);
        return 4;
      }
    const unsigned long long bad = isa::sqrt_newton_mismatches();
    if (bad) {
      std::printf("sqrt_newton differs from vsqrtps on %llu inputs\n", bad);
      return 4;
    }
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
    const int64_t b = n * t / threads / 64 * 64, e = t + 1 == threads ? n : n * (t + 1) / threads / 64 * 64;
    for (int64_t i = b; i < e; ++i) {  // first touch by the owner
      const float pv = 0.5f + 1e-3f * float(i % 1000), gv = 1e-3f * float((i * 7919) % 2001 - 1000);
      const float s0 = 1e-4f * float((i * 31) % 201 - 100), s1 = 1e-4f + 1e-6f * float(i % 777);
      const float vals[4] = {pv, gv, adam ? s0 : s1, s1};
      void* bufs[4] = {p, g, st[0], st[1]};
      for (int k = 0; k < 2 + K; ++k) {
        if (bf) {
          uint32_t u;
          std::memcpy(&u, &vals[k], 4);
          static_cast<uint16_t*>(bufs[k])[i] = uint16_t(u >> 16);
        } else {
          static_cast<float*>(bufs[k])[i] = vals[k];
        }
      }
    }
    for (int r = 0; r < rounds; ++r) {
      for (int k = 0; k < nv; ++k) {
        const int v = (r + k) % nv;  // rotating order
        sync.arrive_and_wait();
        const double t0 = now();
        vs[size_t(v)].second(p, g, st, b, e, sc);
        sync.arrive_and_wait();
        if (t == 0) secs[size_t(v)][size_t(r)] = now() - t0;
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
  std::printf("| %s | %s | %d |", argv[5], argv[4], threads);
  for (int k = 0; k < nv; ++k) {
    std::vector<double> t(secs[size_t(k)].begin() + 1, secs[size_t(k)].end()), ratio;
    for (int r = 1; r < rounds; ++r) ratio.push_back(secs[0][size_t(r)] / secs[size_t(k)][size_t(r)]);
    std::printf(" %.4f (%.3f) |", median(t) / double(n) * 1e9, median(ratio));
  }
  std::printf("\n");
  return 0;
}
