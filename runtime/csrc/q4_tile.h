// The int4 kernel's body, compiled once per instruction set by q4_linear.cpp, which defines
// Q4_NAMESPACE, Q4_DOT(codes, xq) (8 int32 lanes, each the sum of 4 code * activation products)
// and the target before including it. Every integer sum is exact, so both instruction sets give
// the same bits.
namespace Q4_NAMESPACE {

inline float hsum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

// One row of K activations made ready for the kernel: optionally RMS-normalized first
// (y = weight * (x * 1 / sqrt(mean(x^2) + eps)), with `y` as scratch), then quantized per group of 32
// to int8 with scale = max|y| / 127: q = round(y / scale), sum = scale * (sum of q).
void prepare(const float* x, int64_t K, const float* weight, float eps, float* y, int8_t* q,
             float* scale, float* sum) {
  if (weight != nullptr) {
    __m256 squares = _mm256_setzero_ps();
    for (int64_t i = 0; i < K; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      squares = _mm256_add_ps(squares, _mm256_mul_ps(v, v));
    }
    const __m256 inverse = _mm256_set1_ps(1.0f / std::sqrt(hsum(squares) / static_cast<float>(K) + eps));
    for (int64_t i = 0; i < K; i += 8)
      _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), inverse)));
    x = y;
  }
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < K / 32; ++g) {
    const float* xs = x + 32 * g;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xs + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    const __m256 inverse = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m256i i[4];
    for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));  // nearest, ties to even
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * g), _mm256_permutevar8x32_epi32(packed, order));
    const float s = top / 127.0f;
    scale[g] = s;
    sum[g] = s * static_cast<float>(_mm_cvtsi128_si32(t));
  }
}

// out[r * ldo] = sum over groups g of d[g] * (xscale[r, g] * <codes_g, xq_r,g>) + m[g] * xsum[r, g]
// (plus res[r * ldo] when res is given) for TR rows. A row's arithmetic is the same sequence
// whatever TR and whatever rows are beside it, so batching never changes a row's bits. d, m and
// each row of xsum hold Gp floats (G rounded up to 8), zero past G.
template <int TR>
void tile(const int8_t* xq, const float* xscale, const float* xsum, int64_t K, int64_t G, int64_t Gp,
          const uint8_t* codes, const float* d, const float* m, const float* res, float* out, int64_t ldo) {
  __m256 even[TR], odd[TR];
  for (int r = 0; r < TR; ++r) even[r] = odd[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  // Two accumulators a row (even and odd groups), so consecutive groups do not wait on each other.
  auto group = [&](int64_t g, __m256* acc) __attribute__((always_inline)) {
    // 16 bytes hold a group's 32 codes: byte j is code j (low nibble) and code j + 16 (high nibble).
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * g));
    const __m256i q = _mm256_and_si256(
        _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1), low);
    const __m256 dg = _mm256_broadcast_ss(d + g);
    for (int r = 0; r < TR; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + 32 * g));
      const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(Q4_DOT(q, xv)), _mm256_broadcast_ss(xscale + r * G + g));
      acc[r] = _mm256_fmadd_ps(dg, s, acc[r]);
    }
  };
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    group(g, even);
    group(g + 1, odd);
  }
  if (g < G) group(g, even);
  for (int r = 0; r < TR; ++r) {
    __m256 offsets = _mm256_setzero_ps();
    for (int64_t j = 0; j < Gp; j += 8)
      offsets = _mm256_fmadd_ps(_mm256_loadu_ps(m + j), _mm256_loadu_ps(xsum + r * Gp + j), offsets);
    const float y = hsum(_mm256_add_ps(_mm256_add_ps(even[r], odd[r]), offsets));
    out[r * ldo] = res == nullptr ? y : res[r * ldo] + y;
  }
}

// out[0, n) = float(h[0, n)) for n float16 values.
inline void widen(const uint16_t* h, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) out[i] = _cvtsh_ss(h[i]);
}

// Columns [n0, n1) of out [R, N] (plus res [R, N] when given), rows in tiles of up to 4.
void columns(const int8_t* xq, const float* xscale, const float* xsum, int64_t R, int64_t K,
             const uint8_t* codes, const uint16_t* d16, const uint16_t* m16, const float* res, float* out, int64_t N,
             int64_t n0, int64_t n1) {
  const int64_t G = K / 32, Gp = (G + 7) / 8 * 8;
  std::vector<float> d(Gp, 0.0f), m(Gp, 0.0f);
  for (int64_t n = n0; n < n1; ++n) {
    widen(d16 + n * G, G, d.data());
    if (m16 != nullptr) widen(m16 + n * G, G, m.data());
    const uint8_t* c = codes + n * (K / 2);
    int64_t r = 0;
    for (; r + 4 <= R; r += 4)
      tile<4>(xq + r * K, xscale + r * G, xsum + r * Gp, K, G, Gp, c, d.data(), m.data(), res == nullptr ? nullptr : res + r * N + n, out + r * N + n, N);
    const int64_t rest = R - r;
    if (rest == 3) tile<3>(xq + r * K, xscale + r * G, xsum + r * Gp, K, G, Gp, c, d.data(), m.data(), res == nullptr ? nullptr : res + r * N + n, out + r * N + n, N);
    if (rest == 2) tile<2>(xq + r * K, xscale + r * G, xsum + r * Gp, K, G, Gp, c, d.data(), m.data(), res == nullptr ? nullptr : res + r * N + n, out + r * N + n, N);
    if (rest == 1) tile<1>(xq + r * K, xscale + r * G, xsum + r * Gp, K, G, Gp, c, d.data(), m.data(), res == nullptr ? nullptr : res + r * N + n, out + r * N + n, N);
  }
}

}  // namespace Q4_NAMESPACE
