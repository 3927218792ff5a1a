// The loops around a tile of float_linear.cpp, included once in each instruction set's namespace, which
// defines tile<W, RT, CT>(x, K, w, wstride, bias, y, N, next), its tile's ROWS and COLS, ONE_ROW_COLS (a
// one-row tile's columns) and ROW_BLOCK.
// A tile's shape never changes an output's arithmetic, so neither do these loops.

// `next`: the weights the next tile reads, prefetched while the first row tile streams its own.
template <int W, int CT, int RT>
void rows(const float* x, int64_t R, int64_t K, const void* w, int64_t wstride, const float* bias, float* y, int64_t N,
          const char* next) {
  int64_t r = 0;
  for (; r + RT <= R; r += RT, next = nullptr) tile<W, RT, CT>(x + r * K, K, w, wstride, bias, y + r * N, N, next);
  if constexpr (RT > 1) {
    if (r < R) rows<W, CT, RT - 1>(x + r * K, R - r, K, w, wstride, bias, y + r * N, N, next);
  }
}

template <int W>
void columns(const float* x, int64_t R, int64_t K, const void* w, const float* bias, float* y, int64_t N,
             int64_t c0, int64_t c1) {
  const int64_t wstride = K * (W == F32 ? 4 : 2);
  const char* wb = static_cast<const char*>(w);
  for (int64_t r0 = 0; r0 < R; r0 += ROW_BLOCK) {
    const int64_t rows_here = std::min(ROW_BLOCK, R - r0);
    const float* xr = x + r0 * K;
    float* yr = y + r0 * N;
    // From two rows on, the first row tile prefetches the next column tile's weights (a single row has
    // its own loop below). Until 2026-11-26 only several row tiles did: one tile of 2-4 rows prefetching
    // too took SmolLM2 in bfloat16 from 275-296 to 355-436 tok/s at 4 streams and 169-172 to 194-196 at
    // 2, float32 from 277-279 to 386-395 at 4 (in-process, alternating builds, AVX512).
    const bool prefetch = rows_here > 1;
    int64_t c = c0;
    // One row (a stream's decode): more columns a tile, more chains in flight; 2-byte weights, whose
    // rows are short streams for the hardware's prefetcher, prefetch the next tile's (measured).
    if (rows_here == 1)
      for (; c + ONE_ROW_COLS <= c1; c += ONE_ROW_COLS)
        tile<W, 1, ONE_ROW_COLS>(xr, K, wb + c * wstride, wstride, bias ? bias + c : nullptr, yr + c, N,
                                 W != F32 && c + 2 * ONE_ROW_COLS <= c1 ? wb + (c + ONE_ROW_COLS) * wstride : nullptr);
    for (; c + COLS <= c1; c += COLS)
      rows<W, COLS, ROWS>(xr, rows_here, K, wb + c * wstride, wstride, bias ? bias + c : nullptr, yr + c, N,
                             prefetch && c + 2 * COLS <= c1 ? wb + (c + COLS) * wstride : nullptr);
    for (; c < c1; ++c)
      rows<W, 1, ROWS>(xr, rows_here, K, wb + c * wstride, wstride, bias ? bias + c : nullptr, yr + c, N, nullptr);
  }
}
