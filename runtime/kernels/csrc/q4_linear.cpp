// ponder's int4 linear kernel for the CPU (runtime.kernels.cpu_kernels builds it; runtime.model.quantize uses it).
//
// Weights are 4-bit codes in groups of 32 input features, w = d * q + m with a float16 d and m per
// group (a GGUF Q4_1 block's values; Q4_0 has no m), stored in blocks of 8 output columns that the
// kernel computes side by side, a column a vector lane (runtime.model.quantize.pack_int4 writes the layout,
// described at `tile` in q4_tile.h): codes [N / 8, 4 K] bytes, d and m [N / 8, K / 32, 8] float16,
// N rounded up to a block. Activations are quantized per group of 32 to int8 on the way in, as
// llama.cpp does for these blocks, so a group's inner product is an exact integer (vpdpbusd with
// AVX512-VNNI, maddubs summed in int16 lanes and widened once a group with AVX2), rescaled in float32 in a fixed order: each output depends
// only on its own row and column, so a row's bits never depend on the batch, the thread count or the
// instruction set.
//
// The same kernel runs the other GGUF block types (block_tile.h): 4-bit codes with K-quant scales
// (Q4_K; Q2_K's, a scale and a minimum per 16 inputs), 5-bit codes (Q5_0, Q5_1, Q5_K), signed 8-bit
// codes (Q8_0, Q3_K, Q6_K, IQ4_NL, IQ4_XS: a code is the value it stands for) and float32 scales (a
// K-quant's sub-block scale times its super-block's, per 16 inputs for Q2_K, Q3_K and Q6_K), told
// apart by the codes' width and the scales' dtype and shape (`format_of`); activations as above.
//
// q4_linear(x, codes, d, m, n, norm_weight, eps, residual, isa) computes, for float32 x [R, K]:
//   residual + rms_norm(x; norm_weight, eps) @ W.T   [R, n]   (the norm and the residual are optional)
// isa: -1 the best this CPU has, 0 AVX2, 1 AVX512-VNNI.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "ponder_kernels.h"

#include <cmath>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define Q4_NAMESPACE avx2
#define Q4_ROWS 6  // rows a tile: 16 vector registers (a chain and an accumulator a row)
#define Q4_CHAINS 1
// The chain stays in int16 lanes (a lane gains the sum of 2 products a chunk and nibble, 8 over a group) and
// is widened once a group: codes <= 15 and |x| <= 127, so a lane holds at most 8 * 2 * 15 * 127 = 30480,
// maddubs never saturates and every sum is exact. One int16 multiply-add a group instead of one a chunk
// (the multiplier is the bottleneck on CPUs that split 256-bit operations, e.g. AMD Zen 1).
// The empty asm keeps each chain a running sum in its register: left free, the compiler reorders the
// integer adds, computes every product first and spills most of them to the stack.
#define Q4_DOT(acc, q, x) \
  ({ __m256i sum_ = _mm256_add_epi16(acc, _mm256_maddubs_epi16(q, x)); __asm__("" : "+x"(sum_)); sum_; })
#define Q4_SUM(a) _mm256_madd_epi16(a, _mm256_set1_epi16(1))
#include "q4_tile.h"
#define Q_DOT(acc, q, x) Q4_DOT(acc, q, x)
#define Q_WIDEN(a) Q4_SUM(a)
// int16 lanes: a Q_DOT adds at most 2 * 15 * 127 = 3810 (4 bits), 2 * 31 * 127 = 7874 (5 bits) or
// 2 * 128 * 127 = 32512 (8 bits), so a chain takes 8, 4 or 1 of them before it is widened.
#define Q_SPAN(bits) ((bits) == 4 ? 8 : (bits) == 5 ? 4 : 1)
#define Q_ROWS 4
#include "block_tile.h"
#undef Q_DOT
#undef Q_WIDEN
#undef Q_SPAN
#undef Q_ROWS
#undef Q4_DOT
#undef Q4_SUM
#undef Q4_CHAINS
#undef Q4_NAMESPACE
#undef Q4_ROWS
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#define Q4_NAMESPACE vnni
#define Q4_ROWS 8  // rows a tile: 32 vector registers
#define Q4_CHAINS 2  // two independent dpbusd chains a row
#define Q4_DOT(acc, q, x) _mm256_dpbusd_epi32(acc, q, x)
#define Q4_SUM(a, b) _mm256_add_epi32(a, b)
#define Q4_WIDE  // two blocks of columns a tile in 512-bit registers (q4_tile.h's `wide_tile`)
#include "q4_tile.h"
#define Q_DOT(acc, q, x) _mm256_dpbusd_epi32(acc, q, x)
#define Q_WIDEN(a) (a)
#define Q_SPAN(bits) 8  // int32 lanes: never near overflow within a group
#define Q_ROWS 8
#include "block_tile.h"
#undef Q_DOT
#undef Q_WIDEN
#undef Q_SPAN
#undef Q_ROWS
#undef Q4_DOT
#undef Q4_SUM
#undef Q4_CHAINS
#undef Q4_NAMESPACE
#undef Q4_ROWS
#undef Q4_WIDE
#pragma GCC pop_options

bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool has_vnni() {
  return has_avx2() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw");
}

// The highest instruction set `isa = -1` may pick (q4_limit_isa): 1 lets it run AVX512-VNNI where the CPU has it,
// 0 keeps it on the AVX2 path most desktop CPUs run. Both give the same bits.
std::atomic<int64_t> isa_limit{1};

int64_t best_isa() { return has_vnni() && isa_limit.load() >= 1 ? 1 : has_avx2() ? 0 : -1; }

int64_t limit_isa(int64_t limit) {
  TORCH_CHECK(limit == 0 || limit == 1, "q4_limit_isa: 0 (AVX2) or 1 (AVX512-VNNI where present), not ", limit);
  isa_limit.store(limit);
  return best_isa();
}

// The weight format of a layer, told by its buffers' shapes and dtype (see block_tile.h): codes
// [N / 8, bytes_per_input * K] with 4, 5 or 8 bytes an input, d (and m) [N / 8, K / 32 (or K / 16 with
// split), 8], float16 or float32. 0 is q4_tile.h's 4 bits with float16 scales.
int format_of(const at::Tensor& codes, const at::Tensor& d, const c10::optional<at::Tensor>& m, bool with_m,
              int64_t K, int64_t B) {
  const int64_t G = K / 32;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2 && codes.size(0) == B &&
              (codes.size(1) == 4 * K || codes.size(1) == 5 * K || codes.size(1) == 8 * K),
              "q4_linear: codes must be contiguous uint8 [out / 8, 4, 5 or 8 times in]");
  const int bits = static_cast<int>(codes.size(1) / K);
  TORCH_CHECK((d.scalar_type() == at::kHalf || d.scalar_type() == at::kFloat || d.scalar_type() == at::kByte) &&
              d.is_contiguous(), "q4_linear: d must be contiguous float16, float32 or uint8 (K-quant scales)");
  if (d.scalar_type() == at::kByte) {  // [out / 8, in / 256, 16 + 8 * sub-scales a super-block]
    TORCH_CHECK(K % 256 == 0 && d.dim() == 3 && d.size(0) == B && d.size(1) == K / 256 &&
                (d.size(2) == 80 || (d.size(2) == 144 && (bits == 8 || bits == 4))),
                "q4_linear: K-quant scales must be uint8 [out / 8, in / 256, 80] (or 144, a scale per 16, for 4- and "
                "8-bit codes)");
    if (with_m)
      TORCH_CHECK(m->scalar_type() == at::kByte && m->is_contiguous() && m->numel() == d.numel(),
                  "q4_linear: K-quant zero points must be uint8 of d's shape");
    return d.size(2) == 144 ? (bits == 8 ? 10 : 11) : bits == 4 ? 7 : bits == 5 ? 8 : 9;
  }
  const bool is_float = d.scalar_type() == at::kFloat, split = d.numel() == B * 2 * G * 8;
  TORCH_CHECK(d.numel() == B * G * 8 || (split && bits == 8 && is_float),
              "q4_linear: d must be [out / 8, in / 32, 8] (or [out / 8, in / 16, 8] float32 for 8-bit codes)");
  if (with_m)
    TORCH_CHECK(m->scalar_type() == d.scalar_type() && m->is_contiguous() && m->numel() == d.numel(),
                "q4_linear: m must be contiguous, of d's shape and dtype");
  if (!is_float) return bits == 4 ? 0 : bits == 5 ? 1 : 2;
  return split ? 6 : bits == 4 ? 3 : bits == 5 ? 4 : 5;
}

// Column blocks [b0, b1) of out [R, N] for rows already prepared, in `format` on `isa`.
void run_blocks(int format, int64_t isa, const int8_t* xq, const float* xscale, const float* xsum, int64_t R, int64_t K,
                const uint8_t* cp, const void* dp, const void* mp, const float* rp, float* op, int64_t N, int64_t b0,
                int64_t b1) {
  const auto* dh = static_cast<const uint16_t*>(dp);
  const auto* mh = static_cast<const uint16_t*>(mp);
  if (format == 0 && isa == 1)
    vnni::blocks(xq, xscale, xsum, R, K, cp, dh, mh, rp, op, N, b0, b1);
  else if (format == 0)
    avx2::blocks(xq, xscale, xsum, R, K, cp, dh, mh, rp, op, N, b0, b1);
  else if (isa == 1)
    vnni::any_blocks(format, xq, xscale, xsum, R, K, cp, dp, mp, rp, op, N, b0, b1);
  else
    avx2::any_blocks(format, xq, xscale, xsum, R, K, cp, dp, mp, rp, op, N, b0, b1);
}

// Rows a thread prepares at least: about 8192 inputs, so one row (a decode step of one stream) stays on
// the calling thread and 16 rows of a 576-wide model are split (each row's bits are its own either way).
inline int64_t prepare_grain(int64_t K) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(K, 1)); }

// Each row of x [R, K] quantized per group for the kernel (`prepare`), without a norm.
void prepare_rows(const float* xp, int64_t R, int64_t K, int64_t isa, int8_t* xq, float* xscale, float* xsum) {
  const int64_t G = K / 32;
  at::parallel_for(0, R, prepare_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (isa == 1)
        vnni::prepare(xp + r * K, K, nullptr, 0.0f, nullptr, xq + r * K, xscale + r * G, xsum + r * G);
      else
        avx2::prepare(xp + r * K, K, nullptr, 0.0f, nullptr, xq + r * K, xscale + r * G, xsum + r * G);
    }
  });
}

}  // namespace

namespace ponder {

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                     const c10::optional<at::Tensor>& m, int64_t N, const c10::optional<at::Tensor>& norm_weight,
                     double eps, const c10::optional<at::Tensor>& residual, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q4_linear: x must be float32 [rows, in]");
  const int64_t R = x.size(0), K = x.size(1), B = codes.size(0), G = K / 32;
  TORCH_CHECK(K % 32 == 0, "q4_linear: in_features must be a multiple of 32");
  TORCH_CHECK(N > 8 * (B - 1) && N <= 8 * B, "q4_linear: ", N, " outputs do not fill ", B, " blocks of 8");
  const bool with_m = m.has_value() && m->defined();
  const int format = format_of(codes, d, m, with_m, K, B);
  const bool with_norm = norm_weight.has_value() && norm_weight->defined();
  if (with_norm)
    TORCH_CHECK(norm_weight->scalar_type() == at::kFloat && norm_weight->is_contiguous() && norm_weight->numel() == K,
                "q4_linear: norm_weight must be contiguous float32 [in]");
  const bool with_residual = residual.has_value() && residual->defined();
  if (with_residual)
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->is_contiguous() && residual->dim() == 2 &&
                residual->size(0) == R && residual->size(1) == N, "q4_linear: residual must be contiguous float32 [rows, out]");
  if (isa < 0) isa = best_isa();
  TORCH_CHECK(isa == 0 ? has_avx2() : isa == 1 && has_vnni(), "q4_linear: this CPU lacks instruction set ", isa);

  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const float* wp = with_norm ? norm_weight->data_ptr<float>() : nullptr;
  std::vector<int8_t> xq(R * K);
  std::vector<float> xscale(R * G), xsum(R * G), scratch(with_norm ? R * K : 0);
  at::parallel_for(0, R, prepare_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* y = with_norm ? scratch.data() + r * K : nullptr;
      if (isa == 1)
        vnni::prepare(xp + r * K, K, wp, static_cast<float>(eps), y, xq.data() + r * K, xscale.data() + r * G, xsum.data() + r * G);
      else
        avx2::prepare(xp + r * K, K, wp, static_cast<float>(eps), y, xq.data() + r * K, xscale.data() + r * G, xsum.data() + r * G);
    }
  });
  at::Tensor out = at::empty({R, N}, x.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const void* dp = d.data_ptr();
  const void* mp = with_m ? m->data_ptr() : nullptr;
  const float* rp = with_residual ? residual->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B, 2, [&](int64_t b0, int64_t b1) {
    run_blocks(format, isa, xq.data(), xscale.data(), xsum.data(), R, K, cp, dp, mp, rp, op, N, b0, b1);
  });
  return out;
}

at::Tensor q4_linear_segments(const at::Tensor& x, const std::vector<int64_t>& starts,
                              const std::vector<const at::Tensor*>& layers, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "q4_linear_segments: x must be contiguous float32 [rows, in]");
  const int64_t R = x.size(0), K = x.size(1), G = K / 32, S = static_cast<int64_t>(layers.size()), B = (N + 7) / 8;
  TORCH_CHECK(K % 32 == 0 && N > 0 && static_cast<int64_t>(starts.size()) == S + 1 && starts[0] == 0 && starts[S] == R,
              "q4_linear_segments: segments must cover the rows, in_features a multiple of 32");
  std::vector<int> formats(S);
  for (int64_t s = 0; s < S; ++s) {
    const at::Tensor* w = layers[s];
    const c10::optional<at::Tensor> m = present(w[2]);
    formats[s] = format_of(w[0], w[1], m, m.has_value(), K, B);
  }
  const int64_t isa = best_isa();
  TORCH_CHECK(isa >= 0, "q4_linear_segments: this CPU lacks AVX2");
  std::vector<int8_t> xq(R * K);
  std::vector<float> xscale(R * G), xsum(R * G);
  prepare_rows(x.data_ptr<float>(), R, K, isa, xq.data(), xscale.data(), xsum.data());
  at::Tensor out = at::empty({R, N}, x.options());
  float* op = out.data_ptr<float>();
  // One region over every segment's column blocks (segment after segment), grains as q4_linear's.
  at::parallel_for(0, S * B, 2, [&](int64_t a, int64_t b) {
    for (int64_t s = a / B; s < S && s * B < b; ++s) {
      const int64_t b0 = std::max(a, s * B) - s * B, b1 = std::min(b, (s + 1) * B) - s * B, r = starts[s];
      const at::Tensor* w = layers[s];
      run_blocks(formats[s], isa, xq.data() + r * K, xscale.data() + r * G, xsum.data() + r * G, starts[s + 1] - r,
                 K, w[0].data_ptr<uint8_t>(), w[1].data_ptr(), w[2].numel() == 0 ? nullptr : w[2].data_ptr(), nullptr,
                 op + r * N, N, b0, b1);
    }
  });
  return out;
}

}  // namespace ponder

TORCH_LIBRARY(ponder, m) {
  m.def("q4_linear(Tensor x, Tensor codes, Tensor d, Tensor? m, int n, Tensor? norm_weight=None, float eps=0.0, "
        "Tensor? residual=None, int isa=-1) -> Tensor");
  m.def("q4_best_isa() -> int", &best_isa);
  m.def("q4_limit_isa(int limit) -> int", &limit_isa);
}
TORCH_LIBRARY_IMPL(ponder, CPU, m) { m.impl("q4_linear", &ponder::q4_linear); }
