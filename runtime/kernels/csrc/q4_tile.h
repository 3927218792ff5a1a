// The int4 kernel's body, compiled once per instruction set by q4_linear.cpp, which defines
// Q4_NAMESPACE, Q4_DOT(acc, codes, xq) (acc plus, in each 32-bit lane, the sum of its 4 code * activation
// products), Q4_CHAINS (1 or 2 chains a row), Q4_SUM(chains...) (their sums as 8 int32 lanes),
// Q4_ROWS (rows a tile, as many as the vector registers allow)
// and the target before including it. Every integer sum is exact, so both instruction sets give
// the same bits.
namespace Q4_NAMESPACE {

inline float hsum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

// Rows [0, R) in tiles of up to MAX rows: `tile(std::integral_constant<int, T>{}, r)` for the tile of
// T rows starting at row r (T is MAX, 4, 3, 2 or 1: 5 to MAX - 1 rows go as 4, then the rest).
template <int MAX, typename Tile>
inline void row_tiles(int64_t R, Tile&& tile) {
  for (int64_t r = 0; r < R;) {
    const int64_t rows = std::min<int64_t>(MAX, R - r);
    switch (rows) {
      case MAX: tile(std::integral_constant<int, MAX>{}, r); break;
      case 3: tile(std::integral_constant<int, 3>{}, r); break;
      case 2: tile(std::integral_constant<int, 2>{}, r); break;
      case 1: tile(std::integral_constant<int, 1>{}, r); break;
      default: tile(std::integral_constant<int, 4>{}, r); break;
    }
    r += rows > 4 && rows < MAX ? 4 : rows;
  }
}

// `bytes` from `p` into the first-level cache, a line at a time. With more than one row, the tiles
// prefetch the next block's codes (a group at a time) and scales (at once) while the first row tile
// streams its own, so the row tiles after it and the next block find them in cache (SmolLM2
// in-process, 16 streams, AVX512-VNNI: the Q4_1 file 1,080-1,100 -> 1,375-1,400 tok/s, Q8_0 930 ->
// 1,130-1,350; 4 streams +20-25 %; prefill unchanged); one row streams them better from the
// hardware's prefetcher alone (the Q8_0 file, one stream: 254 -> 208 tok/s).
inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

// A tile row's 8 lanes into its first `width` outputs (plus `res`'s when given).
inline void store_row(__m256 acc, const float* res, float* out, int64_t width) {
  alignas(32) float y[8];
  _mm256_store_ps(y, acc);
  for (int64_t j = 0; j < width; ++j) out[j] = res == nullptr ? y[j] : res[j] + y[j];
}

#ifdef Q4_WIDE
// A two-block tile row's 16 lanes: lanes 0-7 into outputs [0, w0), lanes 8-15 into [8, 8 + w1).
inline void store_row_pair(__m512 acc, const float* res, float* out, int64_t w0, int64_t w1) {
  alignas(64) float y[16];
  _mm512_store_ps(y, acc);
  for (int64_t j = 0; j < w0; ++j) out[j] = res == nullptr ? y[j] : res[j] + y[j];
  for (int64_t j = 0; j < w1; ++j) out[8 + j] = res == nullptr ? y[8 + j] : res[8 + j] + y[8 + j];
}
#endif

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

// The columns of one block of 8 (a lane each) for TR rows:
//   out[r * ldo + j] = sum over groups g, in order, of  d[g, j] * (xscale[r, g] * <codes_g,j, xq_r,g>)
//                      then + m[g, j] * xsum[r, g] when there are zero points  (plus res[r * ldo + j] at the end)
// A group's inner product is an exact integer, and a lane's arithmetic is the same sequence whatever
// TR, whatever rows are beside it and whatever the instruction set, so batching never changes a row's
// bits. `codes` holds the block's 128 bytes a group: chunk c (32 bytes) gives lane j 4 bytes, byte t of
// which holds code 8c + t (low nibble) and code 8c + 4 + t (high nibble) of column j's group. `d` and
// `m` hold 8 float16 a group. Only the first `width` lanes are written (a last block may be partial).
template <int TR>
void tile(const int8_t* xq, const float* xscale, const float* xsum, int64_t K, int64_t G, const uint8_t* codes,
          const uint16_t* d, const uint16_t* m, const float* res, float* out, int64_t ldo, int64_t width,
          const uint8_t* next) {
  __m256 acc[TR];
  for (int r = 0; r < TR; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    const __m256 dg = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 8 * g)));
    if (next != nullptr) prefetch(next + 128 * g, 128);
#if Q4_CHAINS == 2
    __m256i a[TR], b[TR];  // two chains a row (low and high nibbles), summed exactly
    for (int r = 0; r < TR; ++r) a[r] = b[r] = _mm256_setzero_si256();
#else
    __m256i a[TR];  // one chain a row, which frees registers for more rows a tile
    for (int r = 0; r < TR; ++r) a[r] = _mm256_setzero_si256();
#endif
    for (int c = 0; c < 4; ++c) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 128 * g + 32 * c));
      const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
      for (int r = 0; r < TR; ++r) {
        const int8_t* x = xq + r * K + 32 * g + 8 * c;
        int32_t x0, x1;
        std::memcpy(&x0, x, 4);
        std::memcpy(&x1, x + 4, 4);
        a[r] = Q4_DOT(a[r], lo, _mm256_set1_epi32(x0));
#if Q4_CHAINS == 2
        b[r] = Q4_DOT(b[r], hi, _mm256_set1_epi32(x1));
#else
        a[r] = Q4_DOT(a[r], hi, _mm256_set1_epi32(x1));
#endif
      }
    }
    for (int r = 0; r < TR; ++r) {
#if Q4_CHAINS == 2
      const __m256i sum = Q4_SUM(a[r], b[r]);
#else
      const __m256i sum = Q4_SUM(a[r]);
#endif
      const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(xscale[r * G + g]));
      acc[r] = _mm256_fmadd_ps(dg, s, acc[r]);
    }
    if (m != nullptr) {
      const __m256 mg = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + 8 * g)));
      for (int r = 0; r < TR; ++r) acc[r] = _mm256_fmadd_ps(mg, _mm256_set1_ps(xsum[r * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < TR; ++r) store_row(acc[r], res == nullptr ? nullptr : res + r * ldo, out + r * ldo, width);
}

#ifdef Q4_WIDE
// `tile` for two blocks of 8 columns side by side in 512-bit registers (AVX512-VNNI): lanes 0-7 are
// block `c0`'s columns and lanes 8-15 block `c1`'s, each lane's arithmetic exactly `tile`'s (the same
// integer chains, summed the same way, then the same float operations in the same order), so the same
// bits from half the instructions a column. `w0` and `w1`: the columns each block writes.
template <int TR>
void wide_tile(const int8_t* xq, const float* xscale, const float* xsum, int64_t K, int64_t G, const uint8_t* c0,
               const uint8_t* c1, const uint16_t* d0, const uint16_t* d1, const uint16_t* m0, const uint16_t* m1,
               const float* res, float* out, int64_t ldo, int64_t w0, int64_t w1, const uint8_t* next) {
  __m512 acc[TR];
  for (int r = 0; r < TR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  auto halves = [](const uint16_t* p0, const uint16_t* p1) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1));
  };
  for (int64_t g = 0; g < G; ++g) {
    const __m512 dg = halves(d0 + 8 * g, d1 + 8 * g);
    if (next != nullptr) {
      prefetch(next + 128 * g, 128);
      prefetch(next + 4 * K + 128 * g, 128);
    }
    __m512i a[TR], b[TR];
    for (int r = 0; r < TR; ++r) a[r] = b[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i w = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c0 + 128 * g + 32 * c))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c1 + 128 * g + 32 * c)), 1);
      const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
      for (int r = 0; r < TR; ++r) {
        const int8_t* x = xq + r * K + 32 * g + 8 * c;
        int32_t x0, x1;
        std::memcpy(&x0, x, 4);
        std::memcpy(&x1, x + 4, 4);
        a[r] = _mm512_dpbusd_epi32(a[r], lo, _mm512_set1_epi32(x0));
        b[r] = _mm512_dpbusd_epi32(b[r], hi, _mm512_set1_epi32(x1));
      }
    }
    for (int r = 0; r < TR; ++r) {
      const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a[r], b[r])), _mm512_set1_ps(xscale[r * G + g]));
      acc[r] = _mm512_fmadd_ps(dg, s, acc[r]);
    }
    if (m0 != nullptr) {
      const __m512 mg = halves(m0 + 8 * g, m1 + 8 * g);
      for (int r = 0; r < TR; ++r) acc[r] = _mm512_fmadd_ps(mg, _mm512_set1_ps(xsum[r * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < TR; ++r)
    store_row_pair(acc[r], res == nullptr ? nullptr : res + r * ldo, out + r * ldo, w0, w1);
}
#endif

// Column blocks [b0, b1) of out [R, N] (plus res [R, N] when given), rows in tiles of up to Q4_ROWS.
void blocks(const int8_t* xq, const float* xscale, const float* xsum, int64_t R, int64_t K, const uint8_t* codes,
            const uint16_t* d, const uint16_t* m, const float* res, float* out, int64_t N, int64_t b0, int64_t b1) {
  const int64_t G = K / 32;
  auto at = [&](const float* p, int64_t r, int64_t n) { return p == nullptr ? nullptr : p + r * N + n; };
#ifdef Q4_WIDE
  // Two blocks at a time where a tile has rows to share them: one row streams a block at a time faster
  // from memory (measured).
  for (; R > 1 && b0 + 1 < b1; b0 += 2) {
    const uint8_t* c = codes + b0 * 4 * K;
    const uint16_t* db = d + b0 * 8 * G;
    const uint16_t* mb = m == nullptr ? nullptr : m + b0 * 8 * G;
    const int64_t n = 8 * b0, w1 = std::min<int64_t>(8, N - n - 8);
    const uint8_t* next = R > 1 && b0 + 3 < b1 ? c + 8 * K : nullptr;
    if (next != nullptr) {  // and the next pair's scales, at once (a few lines)
      prefetch(reinterpret_cast<const uint8_t*>(db + 16 * G), 32 * G);
      if (mb != nullptr) prefetch(reinterpret_cast<const uint8_t*>(mb + 16 * G), 32 * G);
    }
    row_tiles<Q4_ROWS>(R, [&](auto rows, int64_t r) {
      wide_tile<decltype(rows)::value>(xq + r * K, xscale + r * G, xsum + r * G, K, G, c, c + 4 * K, db, db + 8 * G,
                                       mb, mb == nullptr ? nullptr : mb + 8 * G, at(res, r, n), out + r * N + n, N,
                                       8, w1, r == 0 ? next : nullptr);
    });
  }
#endif
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* c = codes + b * 4 * K;
    const uint16_t* db = d + b * 8 * G;
    const uint16_t* mb = m == nullptr ? nullptr : m + b * 8 * G;
    const int64_t n = 8 * b, width = std::min<int64_t>(8, N - n);
    const uint8_t* next = R > 1 && b + 1 < b1 ? c + 4 * K : nullptr;
    if (next != nullptr) {
      prefetch(reinterpret_cast<const uint8_t*>(db + 8 * G), 16 * G);
      if (mb != nullptr) prefetch(reinterpret_cast<const uint8_t*>(mb + 8 * G), 16 * G);
    }
    row_tiles<Q4_ROWS>(R, [&](auto rows, int64_t r) {
      tile<decltype(rows)::value>(xq + r * K, xscale + r * G, xsum + r * G, K, G, c, db, mb, at(res, r, n),
                                  out + r * N + n, N, width, r == 0 ? next : nullptr);
    });
  }
}

}  // namespace Q4_NAMESPACE
