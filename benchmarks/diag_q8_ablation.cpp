// Where the CPU 8-bit kernel's time goes: q8::adam8bit_blocks (adam8bit_kernel.h, AVX-512 with
// VBMI, fp32 params) on its own threads, each thread its share of whole blocks as in the step,
// against the kernel's own 8-bit memory floor (adam8bit_floor_blocks) on the same buffers,
// alternating round by round. benchmarks/diag_q8_ablation.py builds it once per variant from
// copies of the kernel header with one part replaced (DIAG_VARIANT names it; the replacements
// do NOT compute the contract, they are timing probes):
//   full     the kernel as shipped
//   noquant  requantization by truncation instead of the nearest code (no table gathers)
//   nodeq    no dequantization (the block's scratch keeps the previous block's values)
//   nodiv    the division and square root replaced by multiplies
//   none     all three
// Usage: diag_q8_ablation MAPS N ROUNDS THREADS   (MAPS: the two maps' values and midpoints,
// written by the driver from lowbit.py)
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
#include <thread>
#include <vector>

#include "adam_types.h"
#include "q8_tables.h"
namespace mfa {
int prefetch_bytes(int, int) { return 0; }
bool bf16_pairs() { return true; }
bool q8_permute_dequant() { return true; }
namespace isa {
#include "isa_x86.h"
#include "adam_kernel.h"  // the driver's copy, which includes its patched adam8bit_kernel.h
}  // namespace isa
}  // namespace mfa

using namespace mfa;

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  if (argc != 5) return 2;
  const int64_t n = std::atoll(argv[2]);
  const int rounds = std::atoi(argv[3]), threads = std::atoi(argv[4]);
  FILE* f = std::fopen(argv[1], "rb");
  float v1[256], m1[255], v2[256], m2[255];
  if (!f || std::fread(v1, 4, 256, f) + std::fread(m1, 4, 255, f) + std::fread(v2, 4, 256, f) +
                    std::fread(m2, 4, 255, f) != 1022)
    return 3;
  std::fclose(f);
  auto t1 = build_q8_tables(v1, m1), t2 = build_q8_tables(v2, m2);
  // 4 KiB pages, as torch's CPU tensors get them by default.
  auto alloc = [](size_t bytes) {
    const size_t a = size_t(2) << 20;
    bytes = (bytes + a - 1) / a * a;
    void* q = std::aligned_alloc(a, bytes);
    madvise(q, bytes, MADV_NOHUGEPAGE);
    return q;
  };
  const int64_t nb = (n + kQ8Block - 1) / kQ8Block;
  auto* p = static_cast<float*>(alloc(n * 4));
  auto* g = static_cast<float*>(alloc(n * 4));
  auto* c1 = static_cast<uint8_t*>(alloc(n));
  auto* c2 = static_cast<uint8_t*>(alloc(n));
  auto* a1 = static_cast<float*>(alloc(nb * 4));
  auto* a2 = static_cast<float*>(alloc(nb * 4));
  Q8Job job{};
  job.param = p; job.grad = g; job.codes1 = c1; job.absmax1 = a1; job.codes2 = c2; job.absmax2 = a2; job.n = n;
  job.map1 = t1->view();
  job.map2 = t2->view();
  // beta1, beta2, 1 - beta1, 1 - beta2, eps, weight decay, step size, d2, decay, clip; AdamW
  job.s = Adam8bitScalars{0.9f, 0.999f, 0.1f, 0.001f, 1e-8f, 0.01f, 1e-3f, 1.0f, 0.99999f, 100.0f, 1, 0};
  std::barrier sync(threads);
  std::vector<double> secs(size_t(2 * rounds));
  auto worker = [&](int t) {
    cpu_set_t cs;
    CPU_ZERO(&cs);
    CPU_SET(t % int(std::thread::hardware_concurrency()), &cs);
    sched_setaffinity(0, sizeof cs, &cs);
    const int64_t b0 = nb * t / threads, b1 = nb * (t + 1) / threads;
    for (int64_t i = b0 * kQ8Block; i < std::min(n, b1 * kQ8Block); ++i) {  // first touch by the owner
      p[i] = 0.5f + 1e-3f * float(i % 1000);
      g[i] = 1e-3f * float((i * 7919) % 2001 - 1000);
      c1[i] = 127;  // the signed map's zero
      c2[i] = 0;
    }
    for (int64_t b = b0; b < b1; ++b) a1[b] = a2[b] = 0.0f;
    for (int r = 0; r < 2 * rounds; ++r) {
      sync.arrive_and_wait();
      const double s = now();
      if (r % 2 == 0) isa::q8::adam8bit_blocks<float>(job, b0, b1);
      else isa::q8::adam8bit_floor_blocks<float>(job, b0, b1);
      sync.arrive_and_wait();
      if (t == 0) secs[size_t(r)] = now() - s;
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker, t);
  for (auto& th : pool) th.join();
  std::vector<double> step, floor, ratio;
  for (int r = 1; r < rounds; ++r) {  // round 0 warms up
    step.push_back(secs[size_t(2 * r)] / double(n) * 1e9);
    floor.push_back(secs[size_t(2 * r + 1)] / double(n) * 1e9);
    ratio.push_back(floor.back() / step.back());
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("%s %.3f %.3f %.2f\n", DIAG_VARIANT, median(step), median(floor), median(ratio));
  return 0;
}
