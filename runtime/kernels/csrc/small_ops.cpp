// ponder's own arithmetic for the int4 decoder's small operators: runtime.model.decoder's int4 loop
// calls these ops and the int4_layers stack kernel calls the same functions, so the two give the same
// bits. They replace ATen's operators there, whose dispatch cost a one-token step more than their
// arithmetic (about a fifth of the stack kernel's time on a 30-layer model). Each row is computed from
// its own inputs only, in one fixed order, so a row's bits never depend on the batch or the threads.
//
// head_norms(x [T, C], heads N, weight [N, D], eps) -> [T, N, D]: the first N * D columns of each row
//   as N heads of D values, each normed on its own (Qwen3's q and k norms, in one call over both):
//   y = (x * r) * w,  r = 1 / sqrt(s / D + eps),  s = sum of x^2: eight lanes over the head's
//   values in order, the lanes added in one fixed tree, then the tail (D % 8) in order.
// silu_mul(x [T, C], gate G) -> [T, C - G]: silu(g) * u for the gate g = x[:, :G], u = x[:, G:]
//   (C = 2 G), silu(g) = g / (1 + exp(-g)) (g >= 0) or g * e / (1 + e), e = exp(g) (g < 0), exp
//   vec_math.h's.
// argmax_rows(x [R, V]) -> int64 [R]: each row's torch.argmax (the first NaN where there is one, else
//   the first position holding the row's maximum; -0.0 and 0.0 compare equal), the greedy sampler's,
//   vectorized and a row a thread where torch's reduction ran on one (0.6 ms a step of 16 rows of a
//   49k vocabulary). No arithmetic: the same index whatever computes it.
// x float32 with unit stride along a row; both AVX2 + FMA (every CPU the int4 kernel runs on).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ponder_kernels.h"
#include "vec_math.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {

// Rows a thread takes at least, about 4096 values (a few microseconds, the cost of waking the other
// threads): a one-token step stays on the calling thread, a 16-row step of a 576-wide model's MLP
// (16 x 1536 values) is split.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(width, 1)); }

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, op,
              ": x must be float32 [rows, columns] with unit stride along a row");
}

// Row x[0, V)'s argmax as torch.argmax takes it: a NaN is the maximum (the first NaN wins), else the
// first position equal to the maximum.
int64_t argmax_row(const float* x, int64_t V) {
  __m256 top8 = _mm256_set1_ps(-INFINITY), nan8 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top8 = _mm256_max_ps(top8, v);
  }
  bool nan = _mm256_movemask_ps(nan8) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  float top = lanes[0];
  for (int t = 1; t < 8; ++t) top = std::max(top, lanes[t]);
  for (int64_t j = i; j < V; ++j) {
    nan = nan || std::isnan(x[j]);
    top = std::max(top, x[j]);
  }
  if (nan) {
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m256 want = _mm256_set1_ps(top);
  for (i = 0; i + 8 <= V; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), want, _CMP_EQ_OQ));
    if (mask != 0) return i + __builtin_ctz(mask);
  }
  for (; i < V; ++i)
    if (x[i] == top) return i;
  return 0;  // (V == 0 never reaches here: the op refuses it)
}

}  // namespace

namespace ponder {

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be float32 [rows, columns > 0] with unit stride along a row");
  const int64_t R = x.size(0), V = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* yp = out.data_ptr<int64_t>();
  at::parallel_for(0, R, grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) yp[r] = argmax_row(xp + r * stride, V);
  });
  return out;
}

at::Tensor head_norms(const at::Tensor& x, int64_t heads, const at::Tensor& weight, double eps) {
  check_rows(x, "head_norms");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == heads && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous() && heads * weight.size(1) <= x.size(1),
              "head_norms: weight must be contiguous float32 [heads, head_dim] within x's columns");
  const int64_t T = x.size(0), D = weight.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({T, heads, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, grain(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) ponder::norm_head(xp + t * stride + h * D, wp + h * D, D, e, yp + (t * heads + h) * D);
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& x, int64_t gate) {
  check_rows(x, "silu_mul");
  TORCH_CHECK(x.size(1) == 2 * gate, "silu_mul: x must hold the gate's ", gate, " columns, then as many up's");
  const int64_t T = x.size(0), stride = x.stride(0);
  at::Tensor out = at::empty({T, gate}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, T, grain(gate), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) ponder::silu_mul_row(xp + t * stride, xp + t * stride + gate, gate, yp + t * gate);
  });
  return out;
}

}  // namespace ponder

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(ponder, m) {
  m.def("head_norms(Tensor x, int heads, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor x, int gate) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(ponder, CPU, m) {
  m.impl("head_norms", &ponder::head_norms);
  m.impl("silu_mul", &ponder::silu_mul);
  m.impl("argmax_rows", &ponder::argmax_rows);
}
