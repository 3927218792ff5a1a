// Vector arithmetic the kernels share (AVX2 + FMA), each function one fixed sequence of operations, so
// every kernel that calls it gets the same bits for the same inputs on every CPU that runs it.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>

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

// The eight lanes of v added as ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)).
inline float lanes_sum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

// x (one head's D values) normed: y = (x * r) * w, r = 1 / sqrt(s / D + eps), s = sum of x^2: eight
// lanes over the values in order, the lanes added in one fixed tree, then the tail (D % 8) in order.
inline void norm_head(const float* x, const float* w, int64_t D, float eps, float* y) {
  const int64_t full = D - D % 8;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < full; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = lanes_sum(acc);
  for (int64_t i = full; i < D; ++i) s += x[i] * x[i];
  const float r = 1.0f / std::sqrt(s / static_cast<float>(D) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (int64_t i = 0; i < full; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(w + i)));
  for (int64_t i = full; i < D; ++i) y[i] = (x[i] * r) * w[i];
}

// y = silu(g) * u over G values: silu(g) = g / (1 + e) (g >= 0) or g * e / (1 + e), e = exp(-|g|).
inline void silu_mul_row(const float* g, const float* u, int64_t G, float* y) {
  const int64_t full = G - G % 8;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < full; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp_nonpositive(_mm256_or_ps(gv, sign));  // exp(-|g|)
    const __m256 denominator = _mm256_add_ps(one, e);
    const __m256 positive = _mm256_div_ps(gv, denominator);
    const __m256 negative = _mm256_div_ps(_mm256_mul_ps(gv, e), denominator);
    const __m256 silu = _mm256_blendv_ps(negative, positive, _mm256_cmp_ps(gv, zero, _CMP_GE_OQ));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
  }
  // the tail through the same vector arithmetic, one lane at a time
  for (int64_t i = full; i < G; ++i) {
    const __m256 gv = _mm256_set1_ps(g[i]);
    const __m256 e = exp_nonpositive(_mm256_or_ps(gv, sign));
    const __m256 denominator = _mm256_add_ps(one, e);
    const __m256 silu = g[i] >= 0.0f ? _mm256_div_ps(gv, denominator)
                                     : _mm256_div_ps(_mm256_mul_ps(gv, e), denominator);
    y[i] = _mm256_cvtss_f32(silu) * u[i];
  }
}

// sigmoid(g) = 1 / (1 + e) (g >= 0) or e / (1 + e), e = exp(-|g|)
inline __m256 sigmoid(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp_nonpositive(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));
  const __m256 denominator = _mm256_add_ps(one, e);
  return _mm256_blendv_ps(_mm256_div_ps(e, denominator), _mm256_div_ps(one, denominator),
                          _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
}

// y = x * sigmoid(g) over G values, the tail through the same vector arithmetic, one lane at a time.
inline void sigmoid_mul_row(const float* x, const float* g, int64_t G, float* y) {
  const int64_t full = G - G % 8;
  for (int64_t i = 0; i < full; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), sigmoid(_mm256_loadu_ps(g + i))));
  for (int64_t i = full; i < G; ++i) y[i] = x[i] * _mm256_cvtss_f32(sigmoid(_mm256_set1_ps(g[i])));
}

}  // namespace ponder

#pragma GCC pop_options
