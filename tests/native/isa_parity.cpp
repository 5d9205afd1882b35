// Cross-build check: one SIMD build (NEON on arm64, or an x86 build) against the scalar build, bit
// for bit, for every dtype pair, both modes and the memory-floor loop; then the one-state rules
// (Lion with its sign at zero momentum, Adagrad with and without L2, both with maximize) and their
// floor; then stochastic rounding at element indices across 2^32; then 8-bit Adam, dequantized by
// permutes and by gathers. Built with the same flags as the extension by tests/test_native_isa.py:
// NEON runs under qemu-aarch64 on x86-64 machines, the x86 builds natively where the CPU has them.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "adam_types.h"
#include "q8_tables.h"

namespace mfa {
namespace isa_scalar { IsaTable table(); }
namespace MFA_NATIVE_NS { IsaTable table(); }
// dispatch.cpp (the per-vendor choice) is not linked here: a fixed distance, so that the loops'
// prefetch branch runs too. Prefetching moves no bit (tests/test_cpu_kernel.py checks every distance).
int prefetch_bytes(int, int) { return 256; }
// The far prefetch too, past the ends of the tensors included.
int far_prefetch_bytes(int, int) { return 2048; }
// The bf16 pair path on, as by default (test_cpu_kernel.py checks that turning it off moves no bit).
bool bf16_pairs() { return true; }
// The 8-bit section runs with the permute dequantization on (the default) and off.
static bool g_q8_permute = true;
bool q8_permute_dequant() { return g_q8_permute; }
}  // namespace mfa

using namespace mfa;

static uint16_t to_half_bits(float f, bool bf) {
  // Inputs only: exact for the small integers/256 generated below, so the conversion can be plain.
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (bf) return uint16_t(u >> 16);
#if defined(__aarch64__)
  __fp16 h = static_cast<__fp16>(f);
#else
  _Float16 h = static_cast<_Float16>(f);
#endif
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

// n values of dist(rng) / 256 (zeros included), stored as fp32 (elem 4) or as fp16/bf16 bits
// (elem 2); `nonneg` folds them to |x| (second moments, sums of squares).
template <class Rng, class Dist>
std::vector<uint8_t> random_values(int n, int elem, bool bf, bool nonneg, Rng& rng, Dist& dist) {
  std::vector<uint8_t> buf(size_t(n) * elem);
  for (int i = 0; i < n; ++i) {
    float x = dist(rng) / 256.0f;
    if (nonneg) x = x < 0 ? -x : x;
    if (elem == 4) std::memcpy(&buf[size_t(i) * 4], &x, 4);
    else {
      const uint16_t h = to_half_bits(x, bf);
      std::memcpy(&buf[size_t(i) * 2], &h, 2);
    }
  }
  return buf;
}

int main() {
  const IsaTable a = isa_scalar::table(), b = MFA_NATIVE_NS::table();
  const int sizes[] = {1, 3, 4, 5, 17, 1000, 4099};
  // Per Combo (adam_types.h): param and state element sizes; the last two are the bf16
  // stochastic-rounding pairs.
  const int elem[] = {4, 2, 2, 2, 2, 2, 2}, state_elem[] = {4, 4, 2, 4, 2, 4, 2};
  static_assert(sizeof elem / sizeof elem[0] == int(Combo::Count), "one entry per combo");
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> dist(-512, 512);
  int passed = 0, failed = 0;
  for (int combo = 0; combo < int(Combo::Count); ++combo) {
    for (int n : sizes) {
      for (int mode = 0; mode < 6; ++mode) {  // adamw/l2 x maximize x bias-corrected, then floor
        bool floor = mode >= 4;
        // beta1, beta2, 1-beta1, 1-beta2, eps, wd, step size, d2, decay, adamw, maximize (contract v2)
        const bool adamw = (mode & 2) == 0;
        AdamScalars s{0.9f,  0.999f, 0.1f, 0.001f, 1e-8f, 0.05f, mode & 1 ? 1e-2f : 0.1f, mode & 1 ? 1.0f : 31.622776f,
                      adamw ? 0.9995f : 1.0f, adamw, (mode & 1) != 0u};
        std::vector<std::vector<uint8_t>> bufs[2];
        for (int k = 0; k < 2; ++k) bufs[k].resize(4);
        int es[4] = {elem[combo], elem[combo], state_elem[combo], state_elem[combo]};
        for (int t = 0; t < 4; ++t) {  // the second moment (t == 3) stays non-negative
          bufs[0][t] = random_values(n, es[t], combo >= int(Combo::BF16_F32), t == 3, rng, dist);
          bufs[1][t] = bufs[0][t];
        }
        for (int k = 0; k < 2; ++k) {
          const IsaTable& tab = k == 0 ? a : b;
          Span sp{bufs[k][0].data(), bufs[k][1].data(), {bufs[k][2].data(), bufs[k][3].data()}, n};
          sp.sr_key = 0x9E3779B9u ^ uint32_t(n);  // used by the stochastic-rounding combos only
          SpanFn fn = tab.fn[int(floor ? RuleId::Floor : RuleId::Adam)][combo];
          fn(sp, 0, n, &s);
          fn(sp, 0, n, &s);
        }
        bool same = bufs[0] == bufs[1];
        same ? ++passed : ++failed;
        if (!same) std::printf("MISMATCH %s vs %s: combo %d n %d mode %d\n", a.name, b.name, combo, n, mode);
      }
    }
  }
  // One-state rules: mode 0-3 Lion (maximize x weight decay), 4-7 Adagrad (maximize x L2), 8 floor1,
  // 9-10 Lion with lr -1e-2 and -0 (lr's sign bit set: the kernels multiply by sign(c) there).
  for (int combo = 0; combo < int(Combo::Count); ++combo) {
    for (int n : sizes) {
      for (int mode = 0; mode < 11; ++mode) {
        const bool mx = (mode & 1) != 0, wd = (mode & 2) != 0;
        const float lion_lr = mode == 9 ? -1e-2f : mode == 10 ? -0.0f : 1e-2f;
        LionScalars ls{lion_lr, 0.9f, 0.99f, 0.1f, 0.01f, wd ? 0.999f : 1.0f, mx};
        AdagradScalars as{1e-2f, 1e-10f, wd ? 0.1f : 0.0f, wd, mx};
        RuleId id = mode < 4 || mode > 8 ? RuleId::Lion : mode < 8 ? RuleId::Adagrad : RuleId::Floor1;
        const void* scalars = mode >= 4 && mode < 8 ? static_cast<const void*>(&as) : static_cast<const void*>(&ls);
        std::vector<std::vector<uint8_t>> bufs[2];
        for (int k = 0; k < 2; ++k) bufs[k].resize(3);
        int es[3] = {elem[combo], elem[combo], state_elem[combo]};
        for (int t = 0; t < 3; ++t) {  // zeros included: Lion's c = 0 path; Adagrad's state a sum of squares
          bufs[0][t] = random_values(n, es[t], combo >= int(Combo::BF16_F32), t == 2 && id == RuleId::Adagrad, rng,
                                     dist);
          bufs[1][t] = bufs[0][t];
        }
        for (int k = 0; k < 2; ++k) {
          const IsaTable& tab = k == 0 ? a : b;
          Span sp{bufs[k][0].data(), bufs[k][1].data(), {bufs[k][2].data(), nullptr}, n};
          SpanFn fn = tab.fn[int(id)][combo];
          fn(sp, 0, n, scalars);
          fn(sp, 0, n, scalars);
        }
        bool same = bufs[0] == bufs[1];
        same ? ++passed : ++failed;
        if (!same) std::printf("MISMATCH %s vs %s: one-state combo %d n %d mode %d\n", a.name, b.name, combo, n, mode);
      }
    }
  }
  // Stochastic rounding hashes the element index, whose low 32 bits wrap within a vector near
  // 2^32 (the AVX-512 store's slow path). Spans there, reached through base pointers shifted back
  // by `begin` elements: the kernel only ever touches elements begin to end - 1.
  for (int combo : {int(Combo::BF16SR_F32), int(Combo::BF16SR_BF16)}) {
    for (int64_t begin : {(int64_t(1) << 32) - 45, (int64_t(1) << 32) - 16, (int64_t(3) << 32) - 1}) {
      const int n = 100;
      AdamScalars s{0.9f, 0.999f, 0.1f, 0.001f, 1e-8f, 0.05f, 0.1f, 31.622776f, 0.9995f, 1u, 0u};
      std::vector<std::vector<uint8_t>> bufs[2];
      for (int k = 0; k < 2; ++k) bufs[k].resize(4);
      int es[4] = {2, 2, state_elem[combo], state_elem[combo]};
      for (int t = 0; t < 4; ++t) {
        bufs[0][t] = random_values(n, es[t], true, t == 3, rng, dist);
        bufs[1][t] = bufs[0][t];
      }
      for (int k = 0; k < 2; ++k) {
        auto at = [&](int t) { return static_cast<void*>(bufs[k][t].data() - begin * es[t]); };
        Span sp{at(0), at(1), {at(2), at(3)}, begin + n};
        sp.sr_key = 0x2545F491u;
        SpanFn fn = (k == 0 ? a : b).fn[int(RuleId::Adam)][combo];
        fn(sp, begin, begin + n, &s);
        fn(sp, begin + 1, begin + n, &s);  // an odd start: the pair path's odd lanes at even indices
      }
      bool same = bufs[0] == bufs[1];
      same ? ++passed : ++failed;
      if (!same) std::printf("MISMATCH %s vs %s: stochastic rounding combo %d from %lld\n", a.name, b.name, combo,
                             static_cast<long long>(begin));
    }
  }
  // 8-bit Adam (adam8bit_kernel.h): every param storage, both modes, whole and partial blocks,
  // on cubic maps (dense near +-1, sparse near 0, as the dynamic maps are).
  float v1[256], v2[256], m1[255], m2[255];
  for (int i = 0; i < 256; ++i) {
    const float t = (i - 127.5f) / 127.5f, u = i / 255.0f;
    v1[i] = t * t * t;
    v2[i] = u * u * u;
  }
  for (int i = 0; i < 255; ++i) {
    m1[i] = (v1[i] + v1[i + 1]) * 0.5f;
    m2[i] = (v2[i] + v2[i + 1]) * 0.5f;
  }
  const auto t1 = build_q8_tables(v1, m1), t2 = build_q8_tables(v2, m2);
  const int q8_sizes[] = {1, 5, 256, 300, 1000};
  for (int permute = 1; permute >= 0; --permute)
  for (int kind = 0; kind < int(Q8Param::Count); ++kind) {
    g_q8_permute = permute != 0;
    const int pe = kind == int(Q8Param::F32) ? 4 : 2;
    for (int n : q8_sizes) {
      for (int mode = 0; mode < 2; ++mode) {
        const int64_t nb = (n + kQ8Block - 1) / kQ8Block;
        std::vector<uint8_t> bufs[2][4];  // param, grad, codes1, codes2
        std::vector<float> scales[2][2];
        for (int t = 0; t < 2; ++t) bufs[0][t] = random_values(n, pe, kind >= int(Q8Param::BF16), false, rng, dist);
        for (int t = 2; t < 4; ++t) {
          bufs[0][t].resize(size_t(n));
          for (auto& c : bufs[0][t]) c = uint8_t(rng());
        }
        scales[0][0].assign(size_t(nb), 0.5f);
        scales[0][1].assign(size_t(nb), 0.25f);
        for (int t = 0; t < 4; ++t) bufs[1][t] = bufs[0][t];
        scales[1][0] = scales[0][0];
        scales[1][1] = scales[0][1];
        for (int k = 0; k < 2; ++k) {
          Q8Job job{};
          job.param = bufs[k][0].data();
          job.grad = bufs[k][1].data();
          job.codes1 = bufs[k][2].data();
          job.codes2 = bufs[k][3].data();
          job.absmax1 = scales[k][0].data();
          job.absmax2 = scales[k][1].data();
          job.n = n;
          job.map1 = t1->view();
          job.map2 = t2->view();
          job.s = Adam8bitScalars{0.9f, 0.999f, 0.1f, 0.001f, 1e-8f, 0.05f, 1e-2f, 31.622776f, mode ? 1.0f : 0.9995f,
                                  0.5f, mode ? 0u : 1u, mode ? 1u : 0u};
          job.sr_key = 0x85EBCA6Bu ^ uint32_t(n);
          Q8Fn fn = (k == 0 ? a : b).adam8bit[kind];
          fn(job, 0, nb);
          fn(job, 0, nb);
        }
        bool same = scales[0][0] == scales[1][0] && scales[0][1] == scales[1][1];
        for (int t = 0; t < 4; ++t) same = same && bufs[0][t] == bufs[1][t];
        same ? ++passed : ++failed;
        if (!same) std::printf("MISMATCH %s vs %s: 8-bit kind %d n %d mode %d permute %d\n", a.name, b.name, kind, n,
                               mode, permute);
      }
    }
  }
  std::printf("%s vs %s\n%d passed, %d failed\n", b.name, a.name, passed, failed);
  return failed ? 1 : 0;
}
