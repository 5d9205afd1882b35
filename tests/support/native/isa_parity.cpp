// Cross-build check: one SIMD build (NEON on arm64, or an x86 build) against the scalar build, bit
// for bit: every rule of MFA_RULES (adam_types.h; the memory floors included) in every combo and
// mode of its example scalars below (Adam: AdamW/L2 x maximize/bias correction; Lion: its sign at
// zero momentum, weight decay, maximize, a negative lr; Adagrad: with and without L2, maximize),
// and with stochastic rounding at element indices across 2^32; then 8-bit Adam, dequantized by
// permutes and by gathers. Built with the same flags as the extension by tests/test_native_isa.py:
// NEON runs under qemu-aarch64 on x86-64 machines, the x86 builds natively where the CPU has them.
#include <cstdint>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "adam_types.h"
#include "dispatch_stubs.h"
#include "q8_tables.h"

namespace mfa {
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

// Example scalars of every rule of MFA_RULES (adam_types.h): the modes it is run in, and which of
// its states hold non-negative values (second moments, sums of squares). A rule added to MFA_RULES
// needs its overload here (the loop in main() names them all, so the file does not compile
// without it); from then on it runs on every ISA build, for every combo, size and mode below.
template <RuleId> struct Tag {};
template <class Scalars> struct Examples {
  std::vector<Scalars> modes;
  unsigned nonneg_states;  // bit s: state s stays >= 0
};

// beta1, beta2, 1-beta1, 1-beta2, eps, wd, step size, d2, decay, adamw, maximize (contract v2):
// mode bit 0 = maximize with no bias correction, bit 1 = L2 mode.
static AdamScalars adam_example(int mode) {
  const bool adamw = (mode & 2) == 0;
  return AdamScalars{0.9f, 0.999f, 0.1f, 0.001f, 1e-8f, 0.05f, mode & 1 ? 1e-2f : 0.1f, mode & 1 ? 1.0f : 31.622776f,
                     adamw ? 0.9995f : 1.0f, adamw, (mode & 1) != 0u};
}
static Examples<AdamScalars> examples(Tag<RuleId::Adam>) {
  return {{adam_example(0), adam_example(1), adam_example(2), adam_example(3)}, 1u << 1};
}
// The memory floor: Adam's scalars (it reads only weight_decay - weight_decay).
static Examples<AdamScalars> examples(Tag<RuleId::Floor>) { return {{adam_example(0), adam_example(1)}, 1u << 1}; }
// lr, beta1, beta2, 1-beta1, 1-beta2, decay, maximize: maximize x weight decay, then lr -1e-2 and
// -0 (lr's sign bit set: the kernels multiply by sign(c) there). Zero momenta come from the
// random values (Lion's c = 0 path).
static LionScalars lion_example(bool mx, bool wd, float lr) {
  return LionScalars{lr, 0.9f, 0.99f, 0.1f, 0.01f, wd ? 0.999f : 1.0f, mx};
}
static Examples<LionScalars> examples(Tag<RuleId::Lion>) {
  return {{lion_example(false, false, 1e-2f), lion_example(true, false, 1e-2f), lion_example(false, true, 1e-2f),
           lion_example(true, true, 1e-2f), lion_example(true, false, -1e-2f), lion_example(false, true, -0.0f)},
          0u};
}
static Examples<LionScalars> examples(Tag<RuleId::Floor1>) { return {{lion_example(false, false, 1e-2f)}, 0u}; }
// clr, eps, weight_decay, l2, maximize: maximize x L2; the state is a sum of squares.
static Examples<AdagradScalars> examples(Tag<RuleId::Adagrad>) {
  std::vector<AdagradScalars> modes;
  for (int mode = 0; mode < 4; ++mode) {
    const bool mx = (mode & 1) != 0, wd = (mode & 2) != 0;
    modes.push_back(AdagradScalars{1e-2f, 1e-10f, wd ? 0.1f : 0.0f, wd, mx});
  }
  return {modes, 1u << 0};
}

struct Counts {
  int passed = 0, failed = 0;
};

// One rule of MFA_RULES, scalar build (a) against the SIMD build (b), bit for bit: every combo,
// size and mode, two calls each; then the stochastic-rounding combos at element indices across
// 2^32, whose low 32 bits wrap within a vector there (the AVX-512 store's slow path), reached
// through base pointers shifted back by `begin` elements: the kernel only touches begin to end - 1.
template <RuleId Id, class Scalars, int States, class Rng, class Dist>
void check_rule(const char* name, const IsaTable& a, const IsaTable& b, Rng& rng, Dist& dist, Counts& total) {
  static_assert(States >= 1 && States <= kMaxStates, "a rule's states fit a Span");
  const Examples<Scalars> ex = examples(Tag<Id>{});
  const int sizes[] = {1, 3, 4, 5, 17, 1000, 4099};
  // Per Combo (adam_types.h): param and state element sizes; the last two are the bf16
  // stochastic-rounding pairs.
  const int elem[] = {4, 2, 2, 2, 2, 2, 2}, state_elem[] = {4, 4, 2, 4, 2, 4, 2};
  static_assert(sizeof elem / sizeof elem[0] == int(Combo::Count), "one entry per combo");
  constexpr int kTensors = 2 + States;  // param, grad, the states
  Counts c;
  auto compare = [&](const std::vector<uint8_t> (&x)[kTensors], const std::vector<uint8_t> (&y)[kTensors]) {
    bool same = true;
    for (int t = 0; t < kTensors; ++t) same = same && x[t] == y[t];
    same ? ++c.passed : ++c.failed;
    return same;
  };
  auto fill = [&](std::vector<uint8_t> (&bufs)[2][kTensors], int n, const int* es, bool bf) {
    for (int t = 0; t < kTensors; ++t) {
      const bool nonneg = t >= 2 && ((ex.nonneg_states >> (t - 2)) & 1u) != 0;
      bufs[0][t] = random_values(n, es[t], bf, nonneg, rng, dist);  // zeros included
      bufs[1][t] = bufs[0][t];
    }
  };
  for (int combo = 0; combo < int(Combo::Count); ++combo) {
    int es[kTensors] = {elem[combo], elem[combo]};
    for (int t = 2; t < kTensors; ++t) es[t] = state_elem[combo];
    for (int n : sizes) {
      for (size_t mode = 0; mode < ex.modes.size(); ++mode) {
        std::vector<uint8_t> bufs[2][kTensors];
        fill(bufs, n, es, combo >= int(Combo::BF16_F32));
        for (int k = 0; k < 2; ++k) {
          // The key is used by the stochastic-rounding combos only.
          Span sp{bufs[k][0].data(), bufs[k][1].data(), {}, n, 0x9E3779B9u ^ uint32_t(n)};
          for (int t = 0; t < States; ++t) sp.state[t] = bufs[k][2 + t].data();
          SpanFn fn = (k == 0 ? a : b).fn[int(Id)][combo];
          fn(sp, 0, n, &ex.modes[mode]);
          fn(sp, 0, n, &ex.modes[mode]);
        }
        if (!compare(bufs[0], bufs[1]))
          std::printf("MISMATCH %s vs %s: rule %s combo %d n %d mode %d\n", a.name, b.name, name, combo, n,
                      int(mode));
      }
    }
  }
  for (int combo : {int(Combo::BF16SR_F32), int(Combo::BF16SR_BF16)}) {
    int es[kTensors] = {2, 2};
    for (int t = 2; t < kTensors; ++t) es[t] = state_elem[combo];
    for (int64_t begin : {(int64_t(1) << 32) - 45, (int64_t(1) << 32) - 16, (int64_t(3) << 32) - 1}) {
      const int n = 100;
      std::vector<uint8_t> bufs[2][kTensors];
      fill(bufs, n, es, true);
      for (int k = 0; k < 2; ++k) {
        auto at = [&](int t) { return static_cast<void*>(bufs[k][t].data() - begin * es[t]); };
        Span sp{at(0), at(1), {}, begin + n, 0x2545F491u};
        for (int t = 0; t < States; ++t) sp.state[t] = at(2 + t);
        SpanFn fn = (k == 0 ? a : b).fn[int(Id)][combo];
        fn(sp, begin, begin + n, &ex.modes[0]);
        fn(sp, begin + 1, begin + n, &ex.modes[0]);  // an odd start: the pair path's odd lanes at even indices
      }
      if (!compare(bufs[0], bufs[1]))
        std::printf("MISMATCH %s vs %s: rule %s stochastic rounding combo %d from %lld\n", a.name, b.name, name,
                    combo, static_cast<long long>(begin));
    }
  }
  std::printf("rule %s: %d cases, %d mismatches\n", name, c.passed + c.failed, c.failed);
  total.passed += c.passed;
  total.failed += c.failed;
}

int main(int argc, char** argv) {
  const IsaTable a = isa_scalar::table(), b = MFA_NATIVE_NS::table();
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> dist(-512, 512);
  Counts total;
  // Every rule of the list, the memory floors included.
#define MFA_CHECK_RULE(id, name, functor, scalars, states) \
  check_rule<RuleId::id, scalars, states>(name, a, b, rng, dist, total);
  MFA_RULES(MFA_CHECK_RULE)
#undef MFA_CHECK_RULE
  int passed = total.passed, failed = total.failed;
  // 8-bit Adam (adam8bit_kernel.h) on lowbit's two maps (their kernel tables, written to the file
  // named by argv[1] by test_native_isa.py): first the nearest-code search of both builds against
  // a plain count of the midpoints below x, on every fp32 near every midpoint; then the whole
  // step in every param storage, both modes, whole and partial blocks.
  if (argc < 2) {
    std::printf("usage: isa_parity KERNEL_TABLES (lowbit.kernel_table(True) then (False), fp32)\n");
    return 2;
  }
  std::vector<float> kt(2 * kKtSize);
  FILE* f = std::fopen(argv[1], "rb");
  if (!f || std::fread(kt.data(), 4, kt.size(), f) != kt.size()) {
    std::printf("cannot read %s\n", argv[1]);
    return 2;
  }
  std::fclose(f);
  const auto t1 = build_q8_tables(kt.data()), t2 = build_q8_tables(kt.data() + kKtSize);
  for (const Q8Tables* t : {t1.get(), t2.get()}) {
    const float* mids = t->table.data() + kKtMids;
    std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, 2.0f, -2.0f, INFINITY, -INFINITY, NAN, -NAN, 1e-45f, -1e-45f,
                             1e-39f, -1e-39f, 1e-30f, -1e-30f, 3.4e38f, -3.4e38f};
    for (int j = 0; j < kCodes - 1; ++j)
      for (float sign : {1.0f, -1.0f}) {
        float up = sign * mids[j], down = up;
        xs.push_back(up);
        for (int k = 0; k < 3; ++k) {
          up = std::nextafter(up, INFINITY);
          down = std::nextafter(down, -INFINITY);
          xs.push_back(up);
          xs.push_back(down);
        }
      }
    for (int k = 0; k < 20000; ++k) xs.push_back(std::ldexp(float(dist(rng)) / 512.0f, -int(rng() % 30)));
    for (bool floor : {false, true}) {
      std::vector<uint8_t> want(xs.size()), got_a(xs.size()), got_b(xs.size());
      for (size_t i = 0; i < xs.size(); ++i) {
        int c = 0;
        for (int j = 0; j < kCodes - 1; ++j) c += mids[j] < xs[i];
        if (xs[i] != xs[i]) c = 0;
        if (floor && c == int(t->zero) && xs[i] > 0.0f && !t->is_signed) c = 1;
        want[i] = uint8_t(c);
      }
      const Q8Map m = t->view();
      a.q8_quantize(xs.data(), int64_t(xs.size()), m, floor && !t->is_signed, got_a.data());
      b.q8_quantize(xs.data(), int64_t(xs.size()), m, floor && !t->is_signed, got_b.data());
      int bad = 0;
      for (size_t i = 0; i < xs.size(); ++i)
        if (got_a[i] != want[i] || got_b[i] != want[i]) {
          if (++bad <= 5)
            std::printf("MISMATCH quantize %s map: x %a want %d %s %d %s %d\n", t->is_signed ? "signed" : "unsigned",
                        xs[i], want[i], a.name, got_a[i], b.name, got_b[i]);
        }
      bad ? ++failed : ++passed;
    }
  }
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
