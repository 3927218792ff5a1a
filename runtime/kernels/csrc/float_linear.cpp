// ponder's float linear kernel for the CPU (runtime.kernels.cpu_kernels builds it; runtime.model.float_layers'
// FloatLinear uses it): y = x @ W.T + bias for float32 x [R, K] and W [N, K] in float32 or bfloat16, as
// nn.Linear holds it (no repacking, so the weights stay where the checkpoint put them), or in float16
// (a GGUF's F16 tensors, as the file holds them).
//
// Every output is computed in one fixed order, whatever the batch, the tile it falls in, the thread
// count or the instruction set: 16 lanes of fused multiply-add chains over K (lane i takes the inputs
// k = i mod 16, in order), the lanes summed as a fixed tree (i + 8, then i + 4, i + 2, i + 1), then the
// bias added. A bfloat16 or float16 weight widens to float32 exactly, so its products are the same fused
// multiply-adds as the float32 weight of its value. The AVX2 path runs lanes 0-7 and 8-15 as two 8-lane
// chains and sums them in the same tree, so both paths give the same bits. A row's outputs never depend on the other rows: batch
// invariance needs no padding for these layers (runtime.model.row_padding probes only torch's).
//
// Tiles: AVX512 computes 4 rows x 4 columns at once (16 accumulators), AVX2 3 x 3, a half of the lanes
// at a time, and a lone row 8 columns (AVX2 6); the threads split the columns; rows go in blocks of 64 so a block's activations stay in
// cache while the thread's weights stream past them once a block (once a step in decode).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "ponder_kernels.h"

namespace {

constexpr int64_t ROW_BLOCK = 64;

// The weights' type: a template argument of every loop below.
constexpr int F32 = 0, BF16 = 1, F16 = 2;

bool has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx2,fma")
namespace avx512 {

constexpr int ROWS = 4, COLS = 4, ONE_ROW_COLS = 8;

template <int W>
inline __m512 load_w(const void* w, int64_t k) {
  if constexpr (W == BF16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + k));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else if constexpr (W == F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + k)));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(w) + k);
  }
}

inline float reduce(__m512 v) {  // (i + 8), (i + 4), (i + 2), (i + 1): the order the AVX2 path repeats
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

template <int W, int RT, int CT>
void tile(const float* x, int64_t K, const void* w, int64_t wstride, const float* bias, float* y, int64_t N,
          const char* next) {
  __m512 acc[RT][CT];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CT; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[CT];
    for (int c = 0; c < CT; ++c)
      wv[c] = load_w<W>(static_cast<const char*>(w) + c * wstride, k);
    if (next != nullptr && (W == F32 || k % 32 == 0))
      for (int c = 0; c < CT; ++c) _mm_prefetch(next + c * wstride + k * (W == F32 ? 4 : 2), _MM_HINT_T0);
    for (int r = 0; r < RT; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int c = 0; c < CT; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CT; ++c) y[r * N + c] = reduce(acc[r][c]) + (bias ? bias[c] : 0.0f);
}

#include "float_loops.h"

}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

// Lanes 0-7 and 8-15 of the AVX512 path are independent chains, so a tile runs the low half over all
// of K, then the high half (its weights still in L1), each in single 8-lane registers: 3 x 3 chains
// fit AVX2's 16 registers, where pairs held only 2 x 2.
constexpr int ROWS = 3, COLS = 3, ONE_ROW_COLS = 6;

template <int W>
inline __m256 load_w(const void* w, int64_t k) {
  if constexpr (W == BF16) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
  } else if constexpr (W == F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + k)));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(w) + k);
  }
}

inline float reduce(__m256 lo, __m256 hi) {  // the AVX512 path's tree
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

// The chains of lanes `half` * 8 to `half` * 8 + 7 over all of K.
template <int W, int RT, int CT>
void half_tile(const float* x, int64_t K, const void* w, int64_t wstride, int64_t half, __m256 (&acc)[RT][CT],
               const char* next) {
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CT; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = half * 8; k < K; k += 16) {
    __m256 wv[CT];
    for (int c = 0; c < CT; ++c)
      wv[c] = load_w<W>(static_cast<const char*>(w) + c * wstride, k);
    if (next != nullptr && (W == F32 || k % 32 == 0))
      for (int c = 0; c < CT; ++c) _mm_prefetch(next + c * wstride + k * (W == F32 ? 4 : 2), _MM_HINT_T0);
    for (int r = 0; r < RT; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < CT; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
}

template <int W, int RT, int CT>
void tile(const float* x, int64_t K, const void* w, int64_t wstride, const float* bias, float* y, int64_t N,
          const char* next) {
  __m256 lo[RT][CT], hi[RT][CT];
  half_tile<W, RT, CT>(x, K, w, wstride, 0, lo, next);
  half_tile<W, RT, CT>(x, K, w, wstride, 1, hi, nullptr);
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CT; ++c) y[r * N + c] = reduce(lo[r][c], hi[r][c]) + (bias ? bias[c] : 0.0f);
}

#include "float_loops.h"

}  // namespace avx2
#pragma GCC pop_options

}  // namespace

namespace ponder {

// isa: -1 the best this CPU has, 0 AVX2, 1 AVX512. The bits are the same either way.
at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "float_linear: x must be float32 [rows, in]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
              (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16 ||
               weight.scalar_type() == at::kHalf),
              "float_linear: weight must be contiguous float32, bfloat16 or float16 [out, in]");
  const int64_t R = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "float_linear: weight has ", weight.size(1), " inputs, x ", K);
  TORCH_CHECK(K % 16 == 0, "float_linear: in_features must be a multiple of 16");
  const bool with_bias = bias.has_value() && bias->defined();
  if (with_bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "float_linear: bias must be contiguous float32 [out]");
  if (isa < 0) isa = has_avx512() ? 1 : has_avx2() ? 0 : -1;
  TORCH_CHECK(isa == 0 ? has_avx2() : isa == 1 && has_avx512(), "float_linear: this CPU lacks instruction set ", isa);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({R, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const void* wp = weight.data_ptr();
  const float* bp = with_bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int kind = weight.scalar_type() == at::kBFloat16 ? BF16 : weight.scalar_type() == at::kHalf ? F16 : F32;
  if (R == 0 || N == 0) return out;
  // Threads take runs of 48 columns (a multiple of either path's tile width).
  const int64_t chunks = (N + 47) / 48;
  at::parallel_for(0, chunks, 1, [&](int64_t a, int64_t b) {
    const int64_t c0 = a * 48, c1 = std::min(N, b * 48);
#define FLOAT_COLUMNS(NS) \
  kind == BF16 ? NS::columns<BF16>(xp, R, K, wp, bp, op, N, c0, c1) \
  : kind == F16 ? NS::columns<F16>(xp, R, K, wp, bp, op, N, c0, c1) : NS::columns<F32>(xp, R, K, wp, bp, op, N, c0, c1)
    if (isa == 1)
      FLOAT_COLUMNS(avx512);
    else
      FLOAT_COLUMNS(avx2);
#undef FLOAT_COLUMNS
  });
  return out;
}

at::Tensor float_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t isa) {
  if (x.scalar_type() == at::kFloat) return float_linear(x, weight, present(bias), isa);
  const c10::optional<at::Tensor> given = present(bias);
  const c10::optional<at::Tensor> wide_bias =
      given ? c10::optional<at::Tensor>(given->to(at::kFloat)) : c10::optional<at::Tensor>();
  return float_linear(x.to(at::kFloat), weight, wide_bias, isa).to(x.scalar_type());
}

at::Tensor float_linear_segments(const at::Tensor& x, const std::vector<int64_t>& starts,
                                 const std::vector<const at::Tensor*>& weights, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "float_linear_segments: x must be float32 or bfloat16 [rows, in]");
  const int64_t R = x.size(0), K = x.size(1), S = static_cast<int64_t>(weights.size());
  TORCH_CHECK(S > 0 && static_cast<int64_t>(starts.size()) == S + 1 && starts[0] == 0 && starts[S] == R && K % 16 == 0,
              "float_linear_segments: segments must cover the rows, in_features a multiple of 16");
  const int64_t N = weights[0]->size(0);
  std::vector<int> kinds(S);
  for (int64_t s = 0; s < S; ++s) {
    const at::Tensor& w = *weights[s];
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(0) == N && w.size(1) == K &&
                (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf),
                "float_linear_segments: every weight must be contiguous float32, bfloat16 or float16 [out, in]");
    kinds[s] = w.scalar_type() == at::kBFloat16 ? BF16 : w.scalar_type() == at::kHalf ? F16 : F32;
  }
  if (isa < 0) isa = has_avx512() ? 1 : has_avx2() ? 0 : -1;
  TORCH_CHECK(isa == 0 ? has_avx2() : isa == 1 && has_avx512(), "float_linear: this CPU lacks instruction set ", isa);
  const at::Tensor xc = x.to(at::kFloat).contiguous();  // bfloat16 rows widened exactly (FloatLinear.rows)
  at::Tensor out = at::empty({R, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // One region over every segment's runs of 48 columns (float_linear's), segment after segment.
  const int64_t chunks = (N + 47) / 48;
  at::parallel_for(0, S * chunks, 1, [&](int64_t a, int64_t b) {
    for (int64_t s = a / chunks; s < S && s * chunks < b; ++s) {
      const int64_t c0 = (std::max(a, s * chunks) - s * chunks) * 48;
      const int64_t c1 = std::min(N, (std::min(b, (s + 1) * chunks) - s * chunks) * 48);
      const int64_t r = starts[s], rows = starts[s + 1] - r;
      const void* wp = weights[s]->data_ptr();
      const int kind = kinds[s];
#define SEGMENT_COLUMNS(NS) \
  kind == BF16 ? NS::columns<BF16>(xp + r * K, rows, K, wp, nullptr, op + r * N, N, c0, c1) \
  : kind == F16 ? NS::columns<F16>(xp + r * K, rows, K, wp, nullptr, op + r * N, N, c0, c1) \
                : NS::columns<F32>(xp + r * K, rows, K, wp, nullptr, op + r * N, N, c0, c1)
      if (isa == 1)
        SEGMENT_COLUMNS(avx512);
      else
        SEGMENT_COLUMNS(avx2);
#undef SEGMENT_COLUMNS
    }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace ponder

TORCH_LIBRARY_FRAGMENT(ponder, m) {
  m.def("float_linear(Tensor x, Tensor weight, Tensor? bias=None, int isa=-1) -> Tensor");
}
TORCH_LIBRARY_IMPL(ponder, CPU, m) { m.impl("float_linear", &ponder::float_linear); }
