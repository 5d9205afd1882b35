// The CPU quantizer's tables of one 8-bit map (Q8Map in adam_types.h), read from its
// lowbit.kernel_table and checked: header-only, so the native parity test builds them too.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_types.h"

namespace mfa {

constexpr int kCodes = 256;
// lowbit.kernel_table's layout (KT_*).
constexpr int kKtMids = 256, kKtA = 512, kKtC = 528, kKtJhi = 544, kKtJlo = 560, kKtRegion = 576,
              kKtBoundary = 608, kKtSize = 640;

struct Q8Tables {
  std::vector<float> table;  // the kernel table as given
  std::vector<uint32_t> mid_bits, boundaries, region_add;
  std::vector<uint8_t> bytes;
  float unsure = 0.0f;
  uint32_t zero = 0, top = 0, is_signed = 0;
  Q8Map view() const {
    const float* t = table.data();
    return Q8Map{t, bytes.data(), mid_bits.data(), t + kKtA, t + kKtC, t + kKtJhi, t + kKtJlo,
                 reinterpret_cast<const int32_t*>(t + kKtRegion), reinterpret_cast<const uint32_t*>(t + kKtBoundary),
                 boundaries.data(), region_add.data(), unsure, zero, top, is_signed};
  }
};

inline void q8_require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("8-bit map table (lowbit.kernel_table): " + what);
}

// Checks the table's structure and measures how far its estimates stray from the midpoints'
// counts (Q8Map::unsure); throws std::invalid_argument if the search would not be exact.
inline std::unique_ptr<Q8Tables> build_q8_tables(const float* kernel_table) {
  auto t = std::make_unique<Q8Tables>();
  t->table.assign(kernel_table, kernel_table + kKtSize);
  const float* values = kernel_table;
  const float* mids = kernel_table + kKtMids;
  t->bytes.resize(4 * kCodes);
  for (int i = 0; i < kCodes; ++i) {
    const uint32_t u = q8_bits(values[i]);
    for (int k = 0; k < 4; ++k) t->bytes[k * kCodes + i] = uint8_t(u >> (8 * k));
  }
  t->is_signed = values[0] < 0.0f;
  t->zero = t->is_signed ? 127 : 0;
  q8_require(values[t->zero] == 0.0f && values[kCodes - 1] == 1.0f, "0 and 1 are not where they belong");
  for (int i = 0; i + 1 < kCodes - 1; ++i) q8_require(mids[i] < mids[i + 1], "midpoints not ascending");
  if (t->is_signed)
    for (int j = 0; j < 127; ++j) q8_require(mids[j] == -mids[253 - j], "signed map not symmetric");
  for (int j = int(t->zero); j < kCodes - 1; ++j) t->mid_bits.push_back(q8_bits(mids[j]));
  const uint32_t top = t->top = uint32_t(t->mid_bits.size()) - 1;  // N
  Q8Map m = t->view();
  // The regions: 0 up to M_0, 1..7 between their boundaries jlo and jhi, 8 above M_N.
  q8_require(m.jhi[0] == 0.0f && m.jlo[8] == float(top) && m.jhi[8] == float(top + 1), "bad outer regions");
  t->boundaries.push_back(t->mid_bits[0]);
  for (uint32_t r = 1; r <= 7; ++r) {
    q8_require(m.jlo[r] == m.jhi[r - 1] && m.jhi[r] > m.jlo[r] && m.jhi[r] <= float(top), "bad region bounds");
    t->boundaries.push_back(t->mid_bits[uint32_t(m.jhi[r])]);
  }
  q8_require(t->boundaries.back() == t->mid_bits[top], "the last region does not end at M_N");
  for (uint32_t r = 0; r <= 7; ++r) {
    const uint32_t b = t->boundaries[r];
    q8_require(q8_region(b, m) == r && q8_region(b + 1, m) == r + 1, "region tables disagree with the boundaries");
  }
  q8_require(q8_region(0, m) == 0 && q8_region(0x7F800001u, m) == 8, "region tables miss the ends");
  // The one-addition form of q8_region for the binades 2^-31 .. [1, 2) (a fast path's, z clamped
  // below to 2^-31, whose region 0 it shares), checked at each binade's ends and around its boundary.
  t->region_add.resize(32);
  for (uint32_t k = 0; k < 32; ++k) {
    const uint32_t low = (k + 96u) << 23, b = m.boundary[k];
    q8_require(b == 0x7FFFFFFFu || (b >= low && b - low < (1u << 23)), "a region boundary outside its binade");
    const uint32_t carry = b == 0x7FFFFFFFu ? 0u : ((1u << 23) - 1u) - (b - low);
    t->region_add[k] = (uint32_t(m.region[k]) << 23) - low + carry;
  }
  m = t->view();
  for (uint32_t k = 0; k < 32; ++k) {
    const uint32_t low = (k + 96u) << 23, b = m.boundary[k];
    for (uint32_t z : {low, low + (1u << 23) - 1u, b - 1u, b, b + 1u}) {
      if (z < low || z - low >= (1u << 23)) continue;
      q8_require(((z + m.region_add[k]) >> 23) == q8_region(z, m), "one-addition regions disagree with the tables");
    }
  }
  for (uint32_t r = 9; r < 16; ++r)
    q8_require(m.a[r] == m.a[8] && m.c[r] == m.c[8] && m.jhi[r] == m.jhi[8], "pad regions not like region 8");
  // The estimate's error: at each inner midpoint M_j, whose count threshold is j + 1, the estimate
  // of M_j must not exceed j + 1 + unsure and that of the next fp32 above must not fall below
  // j + 1 - unsure; the estimate rises with z, so a lane further than `unsure` from every integer
  // has floor(estimate) = the exact count. At each region's bottom it must reach the region's count.
  float worst = 0.0f;
  for (uint32_t r = 1; r <= 7; ++r) {
    const uint32_t lo = uint32_t(m.jlo[r]), hi = uint32_t(m.jhi[r]);
    q8_require(q8_estimate(t->mid_bits[lo] + 1, r, m) >= float(lo + 1), "estimate below a region's bottom count");
    q8_require(!(q8_estimate(t->mid_bits[hi], r, m) < float(hi)), "estimate below a region's top count");
    for (uint32_t j = lo + 1; j < hi; ++j) {
      const float at = q8_estimate(t->mid_bits[j], r, m) - float(j + 1);
      const float above = float(j + 1) - q8_estimate(t->mid_bits[j] + 1, r, m);
      worst = std::fmax(worst, std::fmax(at, above));
    }
  }
  q8_require(worst < 0.25f, "estimates stray " + std::to_string(worst) + " codes from the midpoints");
  t->unsure = worst;
  return t;
}

}  // namespace mfa
