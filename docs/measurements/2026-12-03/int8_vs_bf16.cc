// Throughput of the inner loops of three ways to apply one 4-bit weight row (K weights, MLX
// affine groups of 64: f32 scale and bias each) to M = 8 activation rows held in L1:
//  f32:  the default path (table lookup to f32, 4 FMAs per 64 weights per row)
//  bf16: the opt-in path (f32 weights rounded to bf16, 2 vdpbf16ps per 64 per row)
//  int8: activations quantized to int8 with one scale per row; per 64 weights and row one
//        vpdpbusd (u8 nibbles x s8), then per group a conversion and an FMA with the group
//        scale (the bias term sum_g b_g * xsum_g is left out: it only adds work)
//  int8/32: int8 with one scale per 32 activations (llama.cpp's Q8 blocks)
// Build: g++ -O2 -march=native int8_vs_bf16.cc
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <vector>
constexpr int K = 1536, M = 8, G = 64, REPS = 20000;
alignas(64) static uint8_t wq[K / 2];
alignas(64) static float sc[K / G], bi[K / G];
alignas(64) static float xf[M][K];
alignas(64) static uint16_t xb[M][K];
alignas(64) static int8_t xi[M][K];
static float out[M];

__attribute__((noinline)) void f32_row() {
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int g = 0; g < K / G; ++g) {
    __m512 t = _mm512_fmadd_ps(_mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15), _mm512_set1_ps(sc[g]), _mm512_set1_ps(bi[g]));
    for (int c = g * G / 32; c < (g + 1) * G / 32; ++c) {
      __m512i v = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(wq + 16 * c)));
      __m512 w0 = _mm512_permutexvar_ps(v, t), w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        acc[m][0] = _mm512_fmadd_ps(w0, _mm512_load_ps(&xf[m][32 * c]), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(w1, _mm512_load_ps(&xf[m][32 * c + 16]), acc[m][1]);
      }
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
}

__attribute__((noinline)) void bf16_row() {
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int g = 0; g < K / G; ++g) {
    __m512 t = _mm512_fmadd_ps(_mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15), _mm512_set1_ps(sc[g]), _mm512_set1_ps(bi[g]));
#pragma GCC unroll 2
    for (int j = 0; j < G / 32; ++j) {
      const int c = g * G / 32 + j;
      __m512i v = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(wq + 16 * c)));
      __m512bh wb = _mm512_cvtne2ps_pbh(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t), _mm512_permutexvar_ps(v, t));
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wb, (__m512bh)_mm512_load_si512(&xb[m][32 * c]));
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
}

__attribute__((noinline)) void int8_row() {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i lo = _mm512_set1_epi8(0x0F);
  for (int g = 0; g < K / G; ++g) {
    // 64 nibbles: 32 bytes -> low nibbles then high nibbles (x permuted to match)
    __m256i b = _mm256_load_si256((const __m256i*)(wq + 32 * g));
    __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
    w = _mm512_and_si512(w, lo);
    const __m512 s = _mm512_set1_ps(sc[g]);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_load_si512(&xi[m][64 * g]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// llama.cpp-style activation scales, one per 32 activations: lanes 0-7 hold block A's 32
// weights, lanes 8-15 block B's (one extra permute per 64 weights), and each row's unit needs
// a per-lane scale vector (dA x 8, dB x 8) times the group scale before the FMA.
alignas(64) static float dvec[M][K / 64][16];
__attribute__((noinline)) void int8_block_row() {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i lo = _mm512_set1_epi8(0x0F);
  const __m512i order = _mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7);
  for (int g = 0; g < K / G; ++g) {
    __m256i b = _mm256_load_si256((const __m256i*)(wq + 32 * g));
    __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
    w = _mm512_permutexvar_epi64(order, _mm512_and_si512(w, lo));
    const __m512 s = _mm512_set1_ps(sc[g]);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_load_si512(&xi[m][64 * g]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(_mm512_load_ps(dvec[m][g]), s), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

template <class F> double time_it(F f) {
  auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < REPS; ++r) f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main() {
  for (int i = 0; i < K / 2; ++i) wq[i] = (i * 37) & 0xFF;
  for (int g = 0; g < K / G; ++g) sc[g] = 0.01f * (g + 1), bi[g] = -0.05f;
  for (int m = 0; m < M; ++m) for (int i = 0; i < K; ++i) { xf[m][i] = 0.001f * ((i * 7 + m) % 100 - 50); xb[m][i] = 0x3f80; xi[m][i] = (i + m) % 100 - 50; }
  const double macs = double(K) * M * REPS;
  for (int round = 0; round < 3; ++round) {
    double a = time_it(f32_row), b = time_it(bf16_row), c = time_it(int8_row), d = time_it(int8_block_row);
    printf("GMAC/s one core: f32 %.1f  bf16 %.1f  int8/row %.1f  int8/32 %.1f   (bf16 %.2fx, int8/row %.2fx, int8/32 %.2fx of f32)\n",
           macs / a / 1e9, macs / b / 1e9, macs / c / 1e9, macs / d / 1e9, a / b, a / c, a / d);
  }
  return out[0] > 1e30;
}
