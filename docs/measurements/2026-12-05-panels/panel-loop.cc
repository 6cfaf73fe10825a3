// Standalone (2026-12-05, sixth session): the 4-bit product of M activation rows against one matrix
// after another (~64 MB of weights in all, so they stream from memory), one core. "old": the
// row kernel of qmm.cc (lanes over K, a 16-entry table per group and row, one activation load
// per FMA, R weight rows at a time); "new P": the panel layout (32 features a vector, weights
// dequantized in registers, a broadcast activation per FMA, P panels at a time); "new2": the
// panel weights dequantized per group into an L1 buffer first, then a 12 x 32 micro-kernel
// (not taken: no faster than dequantizing in registers). Prints G multiply-adds a second.
// Build: g++ -O3 -march=sapphirerapids panel-loop.cc -o panel-loop; run: ./panel-loop K N
// Panel-layout 4-bit kernel vs row-layout kernel, single thread, weights streamed from memory.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
static const int GS = 32;
// OLD: row layout, M rows, table lookup, x loads (qmm.cc rows_avx512_regs, R=1 or 2)
template <int R, int M>
__attribute__((noinline)) void old_rows(const float* xi, const uint8_t* w, const float* s, const float* b, int K, int N, float* out) {
  const int pairs = K / 32, gp = GS / 32;
  for (int n = 0; n < N; n += R) {
    __m512 acc[R][M][2];
    for (int r = 0; r < R; ++r) for (int m = 0; m < M; ++m) acc[r][m][0] = acc[r][m][1] = _mm512_setzero_ps();
    const float* xp = xi;
    for (int g = 0; g < K / GS; ++g) {
      __m512 t[R];
      for (int r = 0; r < R; ++r) t[r] = _mm512_fmadd_ps(_mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15), _mm512_set1_ps(s[(n + r) * (K / GS) + g]), _mm512_set1_ps(b[(n + r) * (K / GS) + g]));
      for (int i = 0; i < gp; ++i, xp += 32 * M) {
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) {
          const uint8_t* wp = w + (size_t)(n + r) * K / 2 + (g * gp + i) * 16;
          _mm_prefetch((const char*)wp + 1024, _MM_HINT_T0);
          __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)wp));
          __m512 w0 = _mm512_permutexvar_ps(v, t[r]), w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t[r]);
#pragma GCC unroll 16
          for (int m = 0; m < M; ++m) {
            acc[r][m][0] = _mm512_fmadd_ps(w0, _mm512_load_ps(xp + 32 * m), acc[r][m][0]);
            acc[r][m][1] = _mm512_fmadd_ps(w1, _mm512_load_ps(xp + 32 * m + 16), acc[r][m][1]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) for (int m = 0; m < M; ++m) out[m * N + n + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m][0], acc[r][m][1]));
  }
}
// NEW: panel layout. w: [N/32][K/4][64 bytes]; s,b: [N/32][K/GS][32]. x: [K][XS] (XS >= M).
// P panels at a time (for M=1 ILP), M rows.
template <int P, int M, int XS>
__attribute__((noinline)) void new_rows(const float* x, const uint8_t* w, const float* s, const float* b, int K, int N, float* out) {
  const __m512 iota = _mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15);
  const size_t pw = (size_t)K * 16;  // bytes per panel
  for (int n = 0; n < N; n += 32 * P) {
    __m512 acc[P][M][2];
    for (int p = 0; p < P; ++p) for (int m = 0; m < M; ++m) acc[p][m][0] = acc[p][m][1] = _mm512_setzero_ps();
    const uint8_t* wp = w + (size_t)(n / 32) * pw;
    const float* sp = s + (size_t)(n / 32) * (K / GS) * 32;
    const float* bp = b + (size_t)(n / 32) * (K / GS) * 32;
    const float* xp = x;
    for (int g = 0; g < K / GS; ++g) {
      __m512 sc[P][2], bi[P][2];
      for (int p = 0; p < P; ++p) for (int h = 0; h < 2; ++h) {
        sc[p][h] = _mm512_loadu_ps(sp + (size_t)p * (K / GS) * 32 + g * 32 + 16 * h);
        bi[p][h] = _mm512_loadu_ps(bp + (size_t)p * (K / GS) * 32 + g * 32 + 16 * h);
      }
      for (int q = 0; q < GS / 4; ++q, wp += 64) {
        __m512i v[P];
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) { v[p] = _mm512_load_si512(wp + p * pw); _mm_prefetch((const char*)(wp + p * pw) + 1024, _MM_HINT_T0); }
#pragma GCC unroll 4
        for (int kk = 0; kk < 4; ++kk, xp += XS) {
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
            for (int p = 0; p < P; ++p) {
              const int sh = 4 * (2 * kk + h);
              __m512i idx = sh ? _mm512_srli_epi32(v[p], sh) : v[p];
              __m512 wv;
              if (M >= 8) wv = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, iota), _mm512_load_ps(sp + (size_t)p * (K / GS) * 32 + g * 32 + 16 * h), _mm512_load_ps(bp + (size_t)p * (K / GS) * 32 + g * 32 + 16 * h));
              else wv = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, iota), sc[p][h], bi[p][h]);
#pragma GCC unroll 12
              for (int m = 0; m < M; ++m) acc[p][m][h] = _mm512_fmadd_ps(_mm512_set1_ps(xp[m]), wv, acc[p][m][h]);
            }
          }
        }
      }
    }
    for (int p = 0; p < P; ++p) for (int m = 0; m < M; ++m) {
      _mm512_storeu_ps(out + m * N + n + 32 * p, acc[p][m][0]);
      _mm512_storeu_ps(out + m * N + n + 32 * p + 16, acc[p][m][1]);
    }
  }
}

// NEW2: panel layout, per group dequantized into an L1 buffer [GS][32], then a 12x32 micro-kernel.
template <int M, int XS>
__attribute__((noinline)) void new2_rows(const float* x, const uint8_t* w, const float* s, const float* b, int K, int N, float* out) {
  const __m512 iota = _mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15);
  const size_t pw = (size_t)K * 16;
  alignas(64) float buf[GS * 32];
  for (int n = 0; n < N; n += 32) {
    __m512 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const uint8_t* wp = w + (size_t)(n / 32) * pw;
    const float* sp = s + (size_t)(n / 32) * (K / GS) * 32;
    const float* bp = b + (size_t)(n / 32) * (K / GS) * 32;
    const float* xp = x;
    for (int g = 0; g < K / GS; ++g) {
      const __m512 s0 = _mm512_load_ps(sp + 32 * g), s1 = _mm512_load_ps(sp + 32 * g + 16);
      const __m512 b0 = _mm512_load_ps(bp + 32 * g), b1 = _mm512_load_ps(bp + 32 * g + 16);
#pragma GCC unroll 8
      for (int q = 0; q < GS / 4; ++q) {
        const __m512i v = _mm512_load_si512(wp + 64 * q);
        _mm_prefetch((const char*)(wp + 64 * q) + 1024, _MM_HINT_T0);
#pragma GCC unroll 4
        for (int kk = 0; kk < 4; ++kk) {
          _mm512_store_ps(buf + 32 * (4 * q + kk), _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * kk), iota), s0, b0));
          _mm512_store_ps(buf + 32 * (4 * q + kk) + 16, _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * kk + 4), iota), s1, b1));
        }
      }
      wp += 16 * GS;
#pragma GCC unroll 4
      for (int k = 0; k < GS; ++k, xp += XS) {
        const __m512 w0 = _mm512_load_ps(buf + 32 * k), w1 = _mm512_load_ps(buf + 32 * k + 16);
#pragma GCC unroll 12
        for (int m = 0; m < M; ++m) {
          const __m512 xv = _mm512_set1_ps(xp[m]);
          acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
          acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      _mm512_storeu_ps(out + m * N + n, acc[m][0]);
      _mm512_storeu_ps(out + m * N + n + 16, acc[m][1]);
    }
  }
}
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
  int K = argc > 1 ? atoi(argv[1]) : 576, N = argc > 2 ? atoi(argv[2]) : 1536;
  const int MATS = (64 << 20) / (K * N / 2);  // ~64 MB of weights
  std::vector<uint8_t*> ws; std::vector<float*> ss, bs;
  for (int i = 0; i < MATS; ++i) {
    uint8_t* w = (uint8_t*)aligned_alloc(64, (size_t)K * N / 2); for (size_t j = 0; j < (size_t)K * N / 2; ++j) w[j] = rand();
    float* s = (float*)aligned_alloc(64, sizeof(float) * N * K / GS); float* b = (float*)aligned_alloc(64, sizeof(float) * N * K / GS);
    for (int j = 0; j < N * K / GS; ++j) { s[j] = 0.01f; b[j] = -0.08f; }
    ws.push_back(w); ss.push_back(s); bs.push_back(b);
  }
  float* x = (float*)aligned_alloc(64, sizeof(float) * K * 16);
  for (int i = 0; i < K * 16; ++i) x[i] = 0.001f * (i % 13);
  std::vector<float> out(16 * N);
  auto run = [&](const char* name, int M, auto f) {
    double best = 1e9;
    for (int it = 0; it < 5; ++it) {
      double t0 = now();
      for (int i = 0; i < MATS; ++i) f(ws[i], ss[i], bs[i]);
      best = std::min(best, now() - t0);
    }
    printf("K=%d N=%d %-12s M=%2d: %6.1f GMAC/s  %.2f ms/mat\n", K, N, name, M, (double)M * K * N * MATS / best / 1e9, best / MATS * 1e3);
  };
  for (int rep = 0; rep < 2; ++rep) {
  run("old R2", 1, [&](auto w, auto s, auto b) { old_rows<2, 1>(x, w, s, b, K, N, out.data()); });
  run("new P4", 1, [&](auto w, auto s, auto b) { new_rows<4, 1, 1>(x, w, s, b, K, N, out.data()); });
  run("new P2", 1, [&](auto w, auto s, auto b) { new_rows<2, 1, 1>(x, w, s, b, K, N, out.data()); });
  run("old", 11, [&](auto w, auto s, auto b) { old_rows<1, 11>(x, w, s, b, K, N, out.data()); });
  run("new P1", 11, [&](auto w, auto s, auto b) { new_rows<1, 11, 12>(x, w, s, b, K, N, out.data()); });
  run("new2", 11, [&](auto w, auto s, auto b) { new2_rows<11, 12>(x, w, s, b, K, N, out.data()); });
  run("new2", 4, [&](auto w, auto s, auto b) { new2_rows<4, 4>(x, w, s, b, K, N, out.data()); });
  run("old", 4, [&](auto w, auto s, auto b) { old_rows<1, 4>(x, w, s, b, K, N, out.data()); });
  run("new P2", 4, [&](auto w, auto s, auto b) { new_rows<2, 4, 4>(x, w, s, b, K, N, out.data()); });
  }
}
