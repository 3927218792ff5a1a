// The block kernel's body for every weight format but 4-bit codes with float16 scales (q4_tile.h's,
// the fastest path), compiled once per instruction set by q4_linear.cpp after q4_tile.h (whose
// `prepare` it shares). q4_linear.cpp defines Q_DOT(acc, codes, xq) (acc plus, in each lane, the sum
// of its 4 unsigned code * signed activation products), Q_WIDEN(acc) (the chain as 8 int32 lanes),
// Q_SPAN(bits) (how many Q_DOT a chain takes before it must be widened: AVX2 keeps it in int16 lanes)
// and Q_ROWS. Every integer sum is exact, so both instruction sets give the same bits.
//
// A format is (bits, scales, split): a weight w = d * q + m, with a d (and m) per group of 32 input
// features (per 16 with `split`), float16, float32 or a K-quant's own form (see
// `load_scales`), the codes q
//   bits 4: 0..15, a group 128 bytes in q4_tile.h's nibble layout;
//   bits 5: 0..31, the low 4 bits as bits 4 plus 32 bytes, lane j's uint32 holding the fifth bits:
//           bit 8t + 2c + h is that of code 8c + 4h + t (chunk c, nibble h, byte t);
//   bits 8: -128..127, a group 256 bytes: chunk c's 64 bytes give lane j 4 bytes of codes 8c + t
//           in its first 32 and of codes 8c + 4 + t in its second 32.
// A lane's arithmetic is the same sequence whatever the rows beside it, so batching never changes a
// row's bits.
namespace Q4_NAMESPACE {

constexpr int64_t group_bytes(int bits) { return bits == 4 ? 128 : bits == 5 ? 160 : 256; }

// Scales: 0 float16 and 1 float32 [groups, 8]; 2 a K-quant's own form, per super-block of 256 inputs
// 8 float16 super-scales then SUB x 8 int8 sub-scales, a scale being their product (exact in float32:
// an 11-bit significand times at most 7 bits), so the same float32 values as form 1 in fewer bytes.
template <int SCALES, int SUB>
inline __m256 load_scales(const void* p, int64_t i) {
  if constexpr (SCALES == 1) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + 8 * i);
  } else if constexpr (SCALES == 2) {
    const uint8_t* base = static_cast<const uint8_t*>(p) + (i / SUB) * (16 + 8 * SUB);
    const __m256 super = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base)));
    const __m128i sub = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(base + 16 + 8 * (i % SUB)));
    return _mm256_mul_ps(super, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sub)));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + 8 * i)));
  }
}

// As q4_tile.h's `tile`, for the formats above: out[r * ldo + j] = sum over groups (and halves with
// `split`), in order, of d[., j] * (xscale[r, g] * <codes, xq>), plus m[g, j] * xsum[r, g] after each group
// (with `split`, after both halves' d terms: m[half, j] * (xscale[r, g] * xs16[r, half]), `xs16` each
// row's integer sums of 16 activations).
template <int TR, int BITS, int SCALES, bool SPLIT>
void block_tile(const int8_t* xq, const float* xscale, const float* xsum, const int32_t* xs16, int64_t K, int64_t G,
                const uint8_t* codes, const void* d, const void* m, const float* res, float* out, int64_t ldo,
                int64_t width, const uint8_t* next) {
  constexpr int span = Q_SPAN(BITS);
  __m256 acc[TR];
  for (int r = 0; r < TR; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), bit = _mm256_set1_epi32(0x01010101);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* cg = codes + group_bytes(BITS) * g;
    if (next != nullptr) prefetch(next + group_bytes(BITS) * g, group_bytes(BITS));
    __m256i high = _mm256_setzero_si256();
    if constexpr (BITS == 5) high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + 128));
    __m256i chain[TR], total[TR], first[TR];
    for (int r = 0; r < TR; ++r) chain[r] = total[r] = first[r] = _mm256_setzero_si256();
    int k = 0;  // Q_DOT calls into the chains so far this group
    for (int c = 0; c < 4; ++c) {
      __m256i lo, hi;
      if constexpr (BITS == 8) {
        lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + 64 * c));
        hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + 64 * c + 32));
      } else {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + 32 * c));
        lo = _mm256_and_si256(w, low);
        hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
        if constexpr (BITS == 5) {
          lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(high, 2 * c), bit), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(high, 2 * c + 1), bit), 4));
        }
      }
      // Signed codes: |code| times the activation carrying the code's sign (the product is the same).
      const __m256i ulo = BITS == 8 ? _mm256_sign_epi8(lo, lo) : lo, uhi = BITS == 8 ? _mm256_sign_epi8(hi, hi) : hi;
      for (int h = 0; h < 2; ++h, ++k) {
        const __m256i u = h == 0 ? ulo : uhi;
        for (int r = 0; r < TR; ++r) {
          int32_t x0;
          std::memcpy(&x0, xq + r * K + 32 * g + 8 * c + 4 * h, 4);
          __m256i xv = _mm256_set1_epi32(x0);
          if constexpr (BITS == 8) xv = _mm256_sign_epi8(xv, h == 0 ? lo : hi);
          chain[r] = Q_DOT(chain[r], u, xv);
        }
        if ((k + 1) % span == 0 || (SPLIT && k == 3)) {
          for (int r = 0; r < TR; ++r) {
            total[r] = _mm256_add_epi32(total[r], Q_WIDEN(chain[r]));
            chain[r] = _mm256_setzero_si256();
          }
        }
        if (SPLIT && k == 3) {
          for (int r = 0; r < TR; ++r) {
            first[r] = total[r];
            total[r] = _mm256_setzero_si256();
          }
        }
      }
    }
    if constexpr (SPLIT) {
      const __m256 d0 = load_scales<SCALES, 16>(d, 2 * g), d1 = load_scales<SCALES, 16>(d, 2 * g + 1);
      for (int r = 0; r < TR; ++r) {
        const __m256 s = _mm256_set1_ps(xscale[r * G + g]);
        acc[r] = _mm256_fmadd_ps(d0, _mm256_mul_ps(_mm256_cvtepi32_ps(first[r]), s), acc[r]);
        acc[r] = _mm256_fmadd_ps(d1, _mm256_mul_ps(_mm256_cvtepi32_ps(total[r]), s), acc[r]);
      }
      if (m != nullptr) {
        const __m256 n0 = load_scales<SCALES, 16>(m, 2 * g), n1 = load_scales<SCALES, 16>(m, 2 * g + 1);
        for (int r = 0; r < TR; ++r) {
          const float s = xscale[r * G + g];
          const int32_t* sums = xs16 + r * 2 * G + 2 * g;
          acc[r] = _mm256_fmadd_ps(n0, _mm256_set1_ps(s * static_cast<float>(sums[0])), acc[r]);
          acc[r] = _mm256_fmadd_ps(n1, _mm256_set1_ps(s * static_cast<float>(sums[1])), acc[r]);
        }
      }
    } else {
      const __m256 dg = load_scales<SCALES, 8>(d, g);
      for (int r = 0; r < TR; ++r) {
        const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(total[r]), _mm256_set1_ps(xscale[r * G + g]));
        acc[r] = _mm256_fmadd_ps(dg, s, acc[r]);
      }
      if (m != nullptr) {
        const __m256 mg = load_scales<SCALES, 8>(m, g);
        for (int r = 0; r < TR; ++r) acc[r] = _mm256_fmadd_ps(mg, _mm256_set1_ps(xsum[r * G + g]), acc[r]);
      }
    }
  }
  for (int r = 0; r < TR; ++r) store_row(acc[r], res == nullptr ? nullptr : res + r * ldo, out + r * ldo, width);
}

#ifdef Q4_WIDE
// Two 8-lane halves as one 512-bit register (lanes 0-7 from `lo`).
inline __m512 join_ps(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
inline __m512i join(const uint8_t* lo, const uint8_t* hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}

// `block_tile` for two blocks of 8 columns side by side in 512-bit registers (q4_tile.h's `wide_tile`
// for these formats): lanes 0-7 are block `c0`'s columns and lanes 8-15 block `c1`'s, each lane's
// integer sums and float operations exactly `block_tile`'s, so the same bits. A signed code c is
// taken as the unsigned c + 128, and 128 times the activations' sum taken off again (`xs16`: each
// row's sums of 16 activations, 2 a group): the same integer sums without a sign operation a row.
// `next`: the codes of the block pair after these (contiguous, 2 x G groups), prefetched a group at a
// time, or null.
template <int TR, int BITS, int SCALES, bool SPLIT>
void wide_block_tile(const int8_t* xq, const float* xscale, const float* xsum, const int32_t* xs16, int64_t K,
                     int64_t G, const uint8_t* c0, const uint8_t* c1, const void* d0, const void* d1, const void* m0,
                     const void* m1, const float* res, float* out, int64_t ldo, int64_t w0, int64_t w1,
                     const uint8_t* next) {
  __m512 acc[TR];
  for (int r = 0; r < TR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), bit = _mm512_set1_epi32(0x01010101), zero = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < G; ++g) {
    const int64_t offset = group_bytes(BITS) * g;
    if (next != nullptr) {
      prefetch(next + offset, group_bytes(BITS));
      prefetch(next + G * group_bytes(BITS) + offset, group_bytes(BITS));
    }
    __m512i high = zero;
    if constexpr (BITS == 5) high = join(c0 + offset + 128, c1 + offset + 128);
    __m512i total[TR], first[TR];
    for (int r = 0; r < TR; ++r) total[r] = first[r] = zero;
    int k = 0;  // dot products into the chains so far this group
    for (int c = 0; c < 4; ++c) {
      __m512i lo, hi;
      if constexpr (BITS == 8) {
        lo = join(c0 + offset + 64 * c, c1 + offset + 64 * c);
        hi = join(c0 + offset + 64 * c + 32, c1 + offset + 64 * c + 32);
      } else {
        const __m512i w = join(c0 + offset + 32 * c, c1 + offset + 32 * c);
        lo = _mm512_and_si512(w, low);
        hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
        if constexpr (BITS == 5) {
          lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, 2 * c), bit), 4));
          hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, 2 * c + 1), bit), 4));
        }
      }
      if constexpr (BITS == 8) {
        lo = _mm512_xor_si512(lo, flip);
        hi = _mm512_xor_si512(hi, flip);
      }
      for (int h = 0; h < 2; ++h, ++k) {
        const __m512i u = h == 0 ? lo : hi;
        for (int r = 0; r < TR; ++r) {
          int32_t x0;
          std::memcpy(&x0, xq + r * K + 32 * g + 8 * c + 4 * h, 4);
          total[r] = _mm512_dpbusd_epi32(total[r], u, _mm512_set1_epi32(x0));
        }
        if (SPLIT && k == 3) {
          for (int r = 0; r < TR; ++r) {
            first[r] = total[r];
            total[r] = zero;
          }
        }
      }
    }
    if constexpr (BITS == 8) {  // the 128s added to the codes, taken off
      for (int r = 0; r < TR; ++r) {
        const int32_t* sums = xs16 + r * 2 * G + 2 * g;
        if constexpr (SPLIT) {
          first[r] = _mm512_sub_epi32(first[r], _mm512_set1_epi32(128 * sums[0]));
          total[r] = _mm512_sub_epi32(total[r], _mm512_set1_epi32(128 * sums[1]));
        } else {
          total[r] = _mm512_sub_epi32(total[r], _mm512_set1_epi32(128 * (sums[0] + sums[1])));
        }
      }
    }
    if constexpr (SPLIT) {
      const __m512 e0 = join_ps(load_scales<SCALES, 16>(d0, 2 * g), load_scales<SCALES, 16>(d1, 2 * g));
      const __m512 e1 = join_ps(load_scales<SCALES, 16>(d0, 2 * g + 1), load_scales<SCALES, 16>(d1, 2 * g + 1));
      for (int r = 0; r < TR; ++r) {
        const __m512 s = _mm512_set1_ps(xscale[r * G + g]);
        acc[r] = _mm512_fmadd_ps(e0, _mm512_mul_ps(_mm512_cvtepi32_ps(first[r]), s), acc[r]);
        acc[r] = _mm512_fmadd_ps(e1, _mm512_mul_ps(_mm512_cvtepi32_ps(total[r]), s), acc[r]);
      }
      if (m0 != nullptr) {
        const __m512 n0 = join_ps(load_scales<SCALES, 16>(m0, 2 * g), load_scales<SCALES, 16>(m1, 2 * g));
        const __m512 n1 = join_ps(load_scales<SCALES, 16>(m0, 2 * g + 1), load_scales<SCALES, 16>(m1, 2 * g + 1));
        for (int r = 0; r < TR; ++r) {
          const float s = xscale[r * G + g];
          const int32_t* sums = xs16 + r * 2 * G + 2 * g;
          acc[r] = _mm512_fmadd_ps(n0, _mm512_set1_ps(s * static_cast<float>(sums[0])), acc[r]);
          acc[r] = _mm512_fmadd_ps(n1, _mm512_set1_ps(s * static_cast<float>(sums[1])), acc[r]);
        }
      }
    } else {
      const __m512 dg = join_ps(load_scales<SCALES, 8>(d0, g), load_scales<SCALES, 8>(d1, g));
      for (int r = 0; r < TR; ++r) {
        const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(total[r]), _mm512_set1_ps(xscale[r * G + g]));
        acc[r] = _mm512_fmadd_ps(dg, s, acc[r]);
      }
      if (m0 != nullptr) {
        const __m512 mg = join_ps(load_scales<SCALES, 8>(m0, g), load_scales<SCALES, 8>(m1, g));
        for (int r = 0; r < TR; ++r) acc[r] = _mm512_fmadd_ps(mg, _mm512_set1_ps(xsum[r * G + g]), acc[r]);
      }
    }
  }
  for (int r = 0; r < TR; ++r)
    store_row_pair(acc[r], res == nullptr ? nullptr : res + r * ldo, out + r * ldo, w0, w1);
}
#endif

// Column blocks [b0, b1) of out [R, N] for one format, rows in tiles of up to Q_ROWS.
template <int BITS, int SCALES, bool SPLIT>
void format_blocks(const int8_t* xq, const float* xscale, const float* xsum, int64_t R, int64_t K, const uint8_t* codes,
                   const void* d, const void* m, const float* res, float* out, int64_t N, int64_t b0, int64_t b1) {
  const int64_t G = K / 32, groups = G * (SPLIT ? 2 : 1);
  const int64_t stride = SCALES == 2 ? (K / 256) * (16 + groups / (K / 256) * 8) : 8 * groups * (SCALES == 1 ? 4 : 2);
  const int64_t mstride = SPLIT || SCALES != 2 ? stride : (K / 256) * 80;
#ifdef Q4_WIDE
  const bool wide_signed = BITS == 8 && R > 1 && b0 + 1 < b1;  // the two-block tiles' signed codes
#else
  const bool wide_signed = false;
#endif
  std::vector<int32_t> xs16((SPLIT && m != nullptr) || wide_signed ? R * 2 * G : 0);  // sums of 16 activations
  for (int64_t i = 0; i < static_cast<int64_t>(xs16.size()); ++i) {
    int32_t sum = 0;
    for (int t = 0; t < 16; ++t) sum += xq[16 * i + t];
    xs16[i] = sum;
  }
  const int32_t* sums = xs16.empty() ? nullptr : xs16.data();
  auto at = [&](const float* p, int64_t r, int64_t n) { return p == nullptr ? nullptr : p + r * N + n; };
#ifdef Q4_WIDE
  // Two blocks at a time where a tile has rows to share them: one row streams a block at a time faster
  // from memory (measured).
  for (; R > 1 && b0 + 1 < b1; b0 += 2) {
    const uint8_t* c = codes + b0 * G * group_bytes(BITS);
    const uint8_t* db = static_cast<const uint8_t*>(d) + b0 * stride;
    const uint8_t* mb = m == nullptr ? nullptr : static_cast<const uint8_t*>(m) + b0 * mstride;
    const int64_t n = 8 * b0, w1 = std::min<int64_t>(8, N - n - 8);
    // With more than one row the first row tile prefetches the next pair's codes (q4_tile.h's `prefetch`).
    const uint8_t* next = R > 1 && b0 + 3 < b1 ? c + 2 * G * group_bytes(BITS) : nullptr;
    if (next != nullptr) {  // and the next pair's scales, at once (a few lines)
      prefetch(db + 2 * stride, 2 * stride);
      if (mb != nullptr) prefetch(mb + 2 * mstride, 2 * mstride);
    }
    row_tiles<Q_ROWS>(R, [&](auto rows, int64_t r) {
      wide_block_tile<decltype(rows)::value, BITS, SCALES, SPLIT>(
          xq + r * K, xscale + r * G, xsum + r * G, sums == nullptr ? nullptr : sums + r * 2 * G, K, G, c,
          c + G * group_bytes(BITS), db, db + stride, mb, mb == nullptr ? nullptr : mb + mstride, at(res, r, n),
          out + r * N + n, N, 8, w1, r == 0 ? next : nullptr);
    });
  }
#endif
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* c = codes + b * G * group_bytes(BITS);
    const void* db = static_cast<const uint8_t*>(d) + b * stride;
    const void* mb = m == nullptr ? nullptr : static_cast<const uint8_t*>(m) + b * mstride;
    const int64_t n = 8 * b, width = std::min<int64_t>(8, N - n);
    const uint8_t* next = R > 1 && b + 1 < b1 ? c + G * group_bytes(BITS) : nullptr;
    if (next != nullptr) {
      prefetch(static_cast<const uint8_t*>(db) + stride, stride);
      if (mb != nullptr) prefetch(static_cast<const uint8_t*>(mb) + mstride, mstride);
    }
    row_tiles<Q_ROWS>(R, [&](auto rows, int64_t r) {
      block_tile<decltype(rows)::value, BITS, SCALES, SPLIT>(xq + r * K, xscale + r * G, xsum + r * G,
                                                             sums == nullptr ? nullptr : sums + r * 2 * G, K, G, c,
                                                             db, mb, at(res, r, n), out + r * N + n, N, width,
                                                             r == 0 ? next : nullptr);
    });
  }
}

// `format_blocks` for the format code (see q4_linear.cpp's `Format`).
inline void any_blocks(int format, const int8_t* xq, const float* xscale, const float* xsum, int64_t R, int64_t K,
                       const uint8_t* codes, const void* d, const void* m, const float* res, float* out, int64_t N,
                       int64_t b0, int64_t b1) {
#define Q_CASE(F, BITS, SCALES, SPLIT) \
  case F: format_blocks<BITS, SCALES, SPLIT>(xq, xscale, xsum, R, K, codes, d, m, res, out, N, b0, b1); break;
  switch (format) {
    Q_CASE(1, 5, 0, false)
    Q_CASE(2, 8, 0, false)
    Q_CASE(3, 4, 1, false)
    Q_CASE(4, 5, 1, false)
    Q_CASE(5, 8, 1, false)
    Q_CASE(6, 8, 1, true)
    Q_CASE(7, 4, 2, false)
    Q_CASE(8, 5, 2, false)
    Q_CASE(9, 8, 2, false)
    Q_CASE(10, 8, 2, true)
    Q_CASE(11, 4, 2, true)
    default: break;
  }
#undef Q_CASE
}

}  // namespace Q4_NAMESPACE
