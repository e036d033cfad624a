// exp(x) for x <= 0, the one exponential of Jitney's CPU kernels: attention's
// softmax (attention_block.h), SiLU (elementwise.cpp, linear_bf16_avx512.cpp's
// fused gate_up) and the sampler's softmax statistics (softmax_stats.cpp).
//
// Range reduction to 2^n * e^r, |r| <= ln2/2, and a degree-6 polynomial:
// about 2 ulp, written so the compiler vectorises it, and the same bits on
// every path (the 16-lane form runs the same IEEE operations in the same
// order; the build's -ffp-contract=off keeps every product and sum apart).

#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace jitney_cpu {

// Scores minus their running maximum, and the like; -inf -> 0.
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  const bool underflow = !(x > -87.0f);  // also -inf
  const float xc = underflow ? -87.0f : x;
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  float r = fmaf(n, -0.693145751953125f, xc);
  r = fmaf(n, -1.428606765330187045e-06f, r);
  float p = 1.0f / 720.0f;
  p = fmaf(p, r, 1.0f / 120.0f);
  p = fmaf(p, r, 1.0f / 24.0f);
  p = fmaf(p, r, 1.0f / 6.0f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // n in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? 0.0f : p * scale;
}

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes: the same IEEE operations in the same order.
__attribute__((always_inline)) inline __m512 exp_nonpositive16(__m512 x) {
  const __mmask16 ok = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);  // not underflow (nor NaN)
  const __m512 xc = _mm512_mask_blend_ps(ok, _mm512_set1_ps(-87.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(ok, p, _mm512_castsi512_ps(bits));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive on 8 lanes: the same IEEE operations in the same order.
__attribute__((always_inline)) inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 ok = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ);  // not underflow (nor NaN)
  const __m256 xc = _mm256_blendv_ps(_mm256_set1_ps(-87.0f), x, ok);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(ok, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
#endif

}  // namespace jitney_cpu
