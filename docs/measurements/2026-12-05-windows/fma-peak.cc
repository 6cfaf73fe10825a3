// Standalone: one core's f32 FMA peak (24 independent AVX-512 chains). Build: g++ -O3 -march=sapphirerapids fma-peak.cc
#include <immintrin.h>
#include <chrono>
#include <cstdio>
int main() {
  for (int rep = 0; rep < 3; ++rep) {
  __m512 a[24]; for (int i = 0; i < 24; ++i) a[i] = _mm512_set1_ps(i * 0.001f);
  __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(0.0001f);
  long n = 200000000 / 16;
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) {
#pragma GCC unroll 24
    for (int j = 0; j < 24; ++j) a[j] = _mm512_fmadd_ps(a[j], b, c);
    asm volatile("" : "+v"(b));
  }
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float s = 0; for (int i = 0; i < 24; ++i) s += _mm512_reduce_add_ps(a[i]);
  printf("%.1f GMAC/s (%g)\n", n * 24.0 * 16 / dt / 1e9, s);
  }
}
