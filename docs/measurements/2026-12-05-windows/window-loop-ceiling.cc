// Standalone: the window kernel's inner loop (4-bit table lookup, one activation load per FMA) on
// L1/L2-resident data, M = 11 rows. VAR 0: as qmm.cc; 1: weights converted instead of looked up;
// 2: no activation loads. Build: g++ -O3 -march=sapphirerapids window-loop-ceiling.cc
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cstdlib>
// VAR 0: full (table + perm); 1: no dequant (w from one load of f32); 2: x reuse (no x loads)
template <int M, int VAR>
__attribute__((noinline)) float run(const float* x, const uint8_t* w, const float* s, int pairs, int rows, size_t wstride) {
  float tot = 0;
  for (int n = 0; n < rows; ++n) {
    __m512 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const uint8_t* wp = w + n * wstride;
    const float* xp = x;
    __m512 x0 = _mm512_set1_ps(1.f), x1 = x0;
    for (int i = 0; i < pairs; ++i, wp += 16, xp += 32 * M) {
      __m512 w0, w1;
      if (VAR == 1) { __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)wp)); w0 = _mm512_cvtepi32_ps(v); w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)); }
      else {
      __m512 t = _mm512_fmadd_ps(_mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15), _mm512_set1_ps(s[2*(n*pairs+i)]), _mm512_set1_ps(s[2*(n*pairs+i)+1]));
      __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)wp));
      w0 = _mm512_permutexvar_ps(v, t), w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t);
      }
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        if (VAR == 2) {
          asm volatile("" : "+v"(x0), "+v"(x1));
          acc[m][0] = _mm512_fmadd_ps(w0, x0, acc[m][0]);
          acc[m][1] = _mm512_fmadd_ps(w1, x1, acc[m][1]);
        } else {
        acc[m][0] = _mm512_fmadd_ps(w0, _mm512_load_ps(xp + 32 * m), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(w1, _mm512_load_ps(xp + 32 * m + 16), acc[m][1]);
        }
      }
    }
    for (int m = 0; m < M; ++m) tot += _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
  }
  return tot;
}
template <int M, int VAR> void bench(int K, int N) {
  int pairs = K / 32;
  float* x = (float*)aligned_alloc(64, sizeof(float) * K * M);
  for (int i = 0; i < K * M; ++i) x[i] = 0.001f * (i % 7);
  std::vector<uint8_t> w(N * pairs * 16, 0x35);
  std::vector<float> s(N * pairs * 2, 0.5f);
  float r = 0;
  double best = 1e9;
  for (int it = 0; it < 30; ++it) {
    auto t0 = std::chrono::steady_clock::now();
    r += run<M, VAR>(x, w.data(), s.data(), pairs, N, pairs * 16);
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt < best) best = dt;
  }
  double mac = double(M) * K * N;
  printf("M=%2d VAR=%d: %.1f GMAC/s %g\n", M, VAR, mac / best / 1e9, r);
}
int main() {
  bench<11,0>(576, 1536); bench<11,1>(576, 1536); bench<11,2>(576, 1536);
  bench<11,0>(4608, 256); bench<11,1>(4608, 256); bench<11,2>(4608, 256);
}
