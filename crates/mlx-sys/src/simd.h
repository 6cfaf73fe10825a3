// Small AVX2 helpers shared by mlx-sys's CPU kernels (qmm.cc, attn.cc): horizontal sum and
// max, exp of non-positive arguments, and SiLU. Each is a fixed sequence of float operations,
// so an element's result depends only on its value (never on its neighbours or position).
#pragma once

#include <cmath>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MLXSYS_X86 1
#define AVX2_FN __attribute__((target("avx2,fma"))) inline
#define AVX2_FN_ALWAYS __attribute__((target("avx2,fma"), always_inline)) inline

namespace mlxsys::simd {

// Whether the CPU has AVX2 and FMA, the target of every AVX2_FN (checked once).
inline bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

AVX2_FN_ALWAYS float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

AVX2_FN_ALWAYS float hmax8(__m256 v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// exp(x) for x <= 0: Cody-Waite range reduction x = n ln2 + r, |r| <= ln2 / 2, and the
// degree-6 polynomial of the Cephes expf; about 1 ulp. x < -87.3 gives 0 (float exp
// underflows there), -inf gives 0.
AVX2_FN_ALWAYS __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(underflow, y);
}

// silu(g) = g * sigmoid(g), with sigmoid from e = exp(-|g|): 1 / (1 + e) for g >= 0 and
// e / (1 + e) below (no overflow for any g).
AVX2_FN_ALWAYS __m256 silu8(__m256 g) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 e = exp_nonpositive(_mm256_or_ps(g, sign));  // exp(-|g|)
  __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_add_ps(_mm256_set1_ps(1.f), e));
  __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), neg);
  return _mm256_mul_ps(g, sig);
}

}  // namespace mlxsys::simd
#endif

namespace mlxsys::simd {
// The portable SiLU, g * sigmoid(g).
inline float silu(float g) { return g / (1.f + std::exp(-g)); }
}  // namespace mlxsys::simd
