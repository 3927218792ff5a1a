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
#undef Q4_DOT
#undef Q4_SUM
#undef Q4_CHAINS
#undef Q4_NAMESPACE
#undef Q4_ROWS
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")
#define Q4_NAMESPACE vnni
#define Q4_ROWS 8  // rows a tile: 32 vector registers
#define Q4_CHAINS 2  // two independent dpbusd chains a row
#define Q4_DOT(acc, q, x) _mm256_dpbusd_epi32(acc, q, x)
#define Q4_SUM(a, b) _mm256_add_epi32(a, b)
#include "q4_tile.h"
#undef Q4_DOT
#undef Q4_SUM
#undef Q4_CHAINS
#undef Q4_NAMESPACE
#undef Q4_ROWS
#pragma GCC pop_options

bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool has_vnni() {
  return has_avx2() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
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

void check_half(const c10::optional<at::Tensor>& t, int64_t count, const char* what) {
  TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == count,
              "q4_linear: ", what, " must be contiguous float16 [out / 8, in / 32, 8]");
}

}  // namespace

namespace ponder {

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                     const c10::optional<at::Tensor>& m, int64_t N, const c10::optional<at::Tensor>& norm_weight,
                     double eps, const c10::optional<at::Tensor>& residual, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q4_linear: x must be float32 [rows, in]");
  const int64_t R = x.size(0), K = x.size(1), B = codes.size(0), G = K / 32;
  TORCH_CHECK(K % 32 == 0, "q4_linear: in_features must be a multiple of 32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2 && codes.size(1) == 4 * K,
              "q4_linear: codes must be contiguous uint8 [out / 8, 4 in]");
  TORCH_CHECK(N > 8 * (B - 1) && N <= 8 * B, "q4_linear: ", N, " outputs do not fill ", B, " blocks of 8");
  check_half(d, B * G * 8, "d");
  const bool with_m = m.has_value() && m->defined();
  if (with_m) check_half(m, B * G * 8, "m");
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
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
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
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = with_m ? reinterpret_cast<const uint16_t*>(m->data_ptr<at::Half>()) : nullptr;
  const float* rp = with_residual ? residual->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B, 2, [&](int64_t b0, int64_t b1) {
    if (isa == 1)
      vnni::blocks(xq.data(), xscale.data(), xsum.data(), R, K, cp, dp, mp, rp, op, N, b0, b1);
    else
      avx2::blocks(xq.data(), xscale.data(), xsum.data(), R, K, cp, dp, mp, rp, op, N, b0, b1);
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
