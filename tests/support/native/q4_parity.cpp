// The 4-bit Adam kernel (adam4bit_kernel.h) of one SIMD build (NEON on arm64, or an x86 build) and
// of the scalar build against the Python reference's own outputs, bit for bit: test_cpu_4bit.py
// writes the maps (lowbit4.kernel_table4), then per case the inputs of one step and
// reference_adam4bit_'s result; the scalar build runs each case's blocks in one call, the SIMD
// build in two (as two threads would split them); then the nearest-code search alone near every
// midpoint of both maps against a plain count. Built with the extension's flags: NEON runs
// under qemu-aarch64 on x86-64 machines, the x86 builds natively where the CPU has them.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "adam_types.h"
#include "dispatch_stubs.h"

namespace mfa {
bool q8_permute_dequant() { return true; }  // the 8-bit kernel's default
}  // namespace mfa

using namespace mfa;

namespace {

struct Reader {
  std::vector<uint8_t> data;
  size_t at = 0;
  bool take(void* out, size_t n) {
    if (at + n > data.size()) return false;
    std::memcpy(out, data.data() + at, n);
    at += n;
    return true;
  }
};

// One step's tensors as raw bytes: param, grad, codes1, absmax1, codes2, absmax2.
struct Tensors {
  std::vector<uint8_t> t[6];
};

// A NaN param's sign and payload are not part of the contract: they follow the CPU's default NaN
// (positive on arm64, negative on x86) and torch's conversion (bf16: 0x7FC0 or 0xFFFF, by code
// path), so a NaN where the reference has a NaN takes the reference's bits before comparing.
void nan_as_want(std::vector<uint8_t>& got, const std::vector<uint8_t>& want, int dtype) {
  const size_t elem = dtype == 0 ? 4 : 2;
  for (size_t i = 0; i + elem <= got.size(); i += elem) {
    uint32_t g = 0, w = 0;
    std::memcpy(&g, &got[i], elem);
    std::memcpy(&w, &want[i], elem);
    auto is_nan = [&](uint32_t u) {
      return dtype == 0 ? (u & 0x7FFFFFFFu) > 0x7F800000u
             : dtype == 1 ? (u & 0x7FFFu) > 0x7C00u
                          : (u & 0x7FFFu) > 0x7F80u;
    };
    if (is_nan(g) && is_nan(w)) std::memcpy(&got[i], &want[i], elem);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::printf("usage: q4_parity CASES (written by tests/test_cpu_4bit.py)\n");
    return 2;
  }
  Reader in;
  if (FILE* f = std::fopen(argv[1], "rb")) {
    uint8_t buf[1 << 16];
    for (size_t got; (got = std::fread(buf, 1, sizeof buf, f)) > 0;) in.data.insert(in.data.end(), buf, buf + got);
    std::fclose(f);
  } else {
    std::printf("cannot read %s\n", argv[1]);
    return 2;
  }
  const IsaTable a = isa_scalar::table(), b = MFA_NATIVE_NS::table();
  float map1[kQ4Table], map2[kQ4Table];
  if (!in.take(map1, sizeof map1) || !in.take(map2, sizeof map2)) {
    std::printf("truncated maps\n");
    return 2;
  }
  int cases = 0, bad = 0;
  while (in.at < in.data.size()) {
    int64_t n;
    int32_t dtype, sr;
    uint32_t key;
    Adam8bitScalars s;
    if (!in.take(&n, 8) || !in.take(&dtype, 4) || !in.take(&key, 4) || !in.take(&sr, 4) || !in.take(&s, sizeof s)) {
      std::printf("truncated case header\n");
      return 2;
    }
    const int64_t nb = (n + kQ4Block - 1) / kQ4Block;
    const size_t elem = dtype == 0 ? 4 : 2;
    const size_t sizes[6] = {size_t(n) * elem, size_t(n) * elem, size_t(n + 1) / 2, size_t(nb) * 4, size_t(n + 1) / 2,
                             size_t(nb) * 4};
    Tensors before, want;
    for (Tensors* t : {&before, &want})
      for (int k = 0; k < 6; ++k) {
        t->t[k].resize(sizes[k]);
        if (!in.take(t->t[k].data(), sizes[k])) {
          std::printf("truncated case %d\n", cases);
          return 2;
        }
      }
    const Q8Param kind = dtype == 0 ? Q8Param::F32 : dtype == 1 ? Q8Param::F16 : sr ? Q8Param::BF16SR : Q8Param::BF16;
    for (int build = 0; build < 2; ++build) {
      Tensors got = before;
      Q4Job job{};
      job.param = got.t[0].data();
      job.grad = got.t[1].data();
      job.codes1 = got.t[2].data();
      job.absmax1 = reinterpret_cast<float*>(got.t[3].data());
      job.codes2 = got.t[4].data();
      job.absmax2 = reinterpret_cast<float*>(got.t[5].data());
      job.n = n;
      job.s = s;
      job.sr_key = key;
      std::memcpy(job.map1, map1, sizeof map1);
      std::memcpy(job.map2, map2, sizeof map2);
      const IsaTable& isa = build == 0 ? a : b;
      Q4Fn fn = isa.adam4bit[int(kind)];
      if (build == 0) {
        fn(job, 0, nb);
      } else {
        fn(job, 0, nb / 2);
        fn(job, nb / 2, nb);
      }
      for (int k = 0; k < 6; ++k) {
        if (k == 0) nan_as_want(got.t[0], want.t[0], dtype);
        if (got.t[k] == want.t[k]) continue;
        size_t at = 0;
        while (got.t[k][at] == want.t[k][at]) ++at;
        ++bad;
        std::printf("MISMATCH %s vs reference: case %d n %lld dtype %d sr %d: tensor %d byte %zu: %02x, want %02x\n",
                    isa.name, cases, static_cast<long long>(n), dtype, sr, k, at, got.t[k][at], want.t[k][at]);
        break;
      }
    }
    ++cases;
  }
  std::printf("%s and scalar vs reference: %d cases, %d mismatches\n", b.name, cases, bad);
  // The search alone on both maps against a plain count of the midpoints below x: every midpoint
  // and its 3 fp32 neighbours each way, both signs, the specials, values over 30 binades.
  int search_bad = 0;
  size_t values = 0;
  for (const float* map : {map1, map2}) {
    std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, 2.0f, -2.0f, INFINITY, -INFINITY, NAN, -NAN, 1e-45f, -1e-45f,
                             1e-39f, -1e-39f, 3.4e38f, -3.4e38f};
    for (int k = 0; k < 32; ++k)
      for (float sign : {1.0f, -1.0f}) {
        float up = sign * map[k], down = up;
        xs.push_back(up);
        for (int j = 0; j < 3; ++j) {
          up = std::nextafter(up, INFINITY);
          down = std::nextafter(down, -INFINITY);
          xs.push_back(up);
          xs.push_back(down);
        }
      }
    for (int k = 0; k < 4000; ++k) xs.push_back(std::ldexp(float(int(k * 2654435761u % 2049) - 1024) / 1024.0f, -(k % 30)));
    if (xs.size() % 2 == 0) xs.push_back(0.5f);  // an odd count: the pad nibble too
    std::vector<uint8_t> want((xs.size() + 1) / 2, 0), got_a(want.size(), 0xFF), got_b(want.size(), 0xFF);
    for (size_t i = 0; i < xs.size(); ++i) {
      int c = 0;
      for (int j = 0; j < 15; ++j) c += map[16 + j] < xs[i];
      want[i / 2] |= uint8_t(c << (i % 2 ? 0 : 4));
    }
    a.q4_quantize(xs.data(), int64_t(xs.size()), map, got_a.data());
    b.q4_quantize(xs.data(), int64_t(xs.size()), map, got_b.data());
    for (size_t i = 0; i < want.size(); ++i)
      if (got_a[i] != want[i] || got_b[i] != want[i]) {
        if (++search_bad <= 5)
          std::printf("MISMATCH search %s map: x %a %a want %02x %s %02x %s %02x\n", map == map1 ? "signed" : "unsigned",
                      xs[2 * i], 2 * i + 1 < xs.size() ? xs[2 * i + 1] : 0.0f, want[i], a.name, got_a[i], b.name,
                      got_b[i]);
      }
    values += xs.size();
  }
  std::printf("search: %zu values, %d mismatches\n", values, search_bad);
  return bad || search_bad || cases == 0 ? 1 : 0;
}
