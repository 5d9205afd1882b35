// Throughput of the numeric contract's per-element division and square root alone,
// u = m / (sqrt(v) * d2 + eps), with vsqrtps and vdivps on 16-lane vectors over L1-resident
// arrays, 1 thread: what every AVX-512 step of the contract spends on them at least (a square root
// from vrsqrt14ps and Newton steps, bit-identical, was slower in the real kernels; README).
// g++ -O2 -mavx512f benchmarks/diag_divsqrt.cpp -o /tmp/divsqrt && /tmp/divsqrt
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <vector>
int main() {
  const int n = 4096, reps = 200000;
  std::vector<float> m(n, 0.01f), v(n, 1e-4f), out(n);
  for (int i = 0; i < n; ++i) { m[i] = 0.001f * (i % 97 + 1); v[i] = 1e-6f * (i % 89 + 1); }
  const __m512 d2 = _mm512_set1_ps(31.6f), eps = _mm512_set1_ps(1e-8f);
  double best = 1e9;
  for (int t = 0; t < 5; ++t) {
    auto s = std::chrono::steady_clock::now();
    for (int r = 0; r < reps / 5; ++r)
      for (int i = 0; i < n; i += 16) {
        __m512 den = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(_mm512_loadu_ps(&v[i])), d2), eps);
        _mm512_storeu_ps(&out[i], _mm512_div_ps(_mm512_loadu_ps(&m[i]), den));
      }
    double d = std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count() / (double(reps / 5) * n);
    if (d < best) best = d;
  }
  std::printf("div+sqrt alone (zmm, L1, 1 thread): %.3f ns per element (%.2f ns per 16 lanes); out %g\n", best * 1e9, best * 16e9, out[7]);
}
