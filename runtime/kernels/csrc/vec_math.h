// Vector arithmetic the kernels share (AVX2 + FMA), each function one fixed sequence of operations, so
// every kernel that calls it gets the same bits for the same inputs on every CPU that runs it.
#pragma once
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace ponder {

// exp(x) for x <= 0: 2^n * p(r), x = n ln 2 + r, |r| <= ln 2 / 2, p the degree-6 Taylor polynomial
// (relative error about 2e-7); 0 below -87 (where float32 loses normal numbers).
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 floor_x = _mm256_set1_ps(-87.0f);
  const __m256 zero_below = _mm256_cmp_ps(x, floor_x, _CMP_GE_OQ);
  x = _mm256_max_ps(x, floor_x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts: r exact-ish
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(scale)), zero_below);
}

}  // namespace ponder

#pragma GCC pop_options
