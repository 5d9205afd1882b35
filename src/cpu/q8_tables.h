// The CPU quantizer's tables of one 8-bit map (Q8Map in adam_types.h), built from its 256 code
// values and 255 midpoints: header-only, so the native parity test builds them too.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "adam_types.h"

namespace mfa {

constexpr int kCodes = 256;

struct Q8Tables {
  std::vector<float> values, mid;
  std::vector<uint32_t> bucket;
  std::vector<uint8_t> bytes;
  Q8Map view() const { return Q8Map{values.data(), bucket.data(), bytes.data()}; }
};

inline uint32_t order_key(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Throws std::invalid_argument if a bucket of 2^16 fp32 bit patterns holds two midpoints (then
// one comparison could not find the nearest code); lowbit's maps never do.
inline std::unique_ptr<Q8Tables> build_q8_tables(const float* values, const float* mids) {
  auto t = std::make_unique<Q8Tables>();
  t->values.assign(values, values + kCodes);
  t->mid.assign(mids, mids + kCodes - 1);
  t->bytes.resize(4 * kCodes);
  for (int i = 0; i < kCodes; ++i) {
    uint32_t u;
    std::memcpy(&u, &values[i], 4);
    for (int k = 0; k < 4; ++k) t->bytes[k * kCodes + i] = uint8_t(u >> (8 * k));
  }
  t->bucket.assign(size_t(1) << 16, 0);
  uint32_t c = 0;
  for (uint32_t bucket = 0; bucket < (1u << 16); ++bucket) {
    while (c < kCodes - 1 && (order_key(mids[c]) >> 16) < bucket) ++c;
    uint32_t low = 0xFFFF;  // no midpoint here: no x of the bucket lies above one
    if (c < kCodes - 1 && (order_key(mids[c]) >> 16) == bucket) {
      low = order_key(mids[c]) & 0xFFFF;
      if (c + 1 < kCodes - 1 && (order_key(mids[c + 1]) >> 16) == bucket)
        throw std::invalid_argument("8-bit map: two midpoints within 2^16 fp32 bit patterns; not supported");
    }
    t->bucket[bucket] = (c << 16) | low;
  }
  return t;
}

}  // namespace mfa
