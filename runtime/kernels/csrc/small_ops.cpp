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

// Rows a thread takes at least: a one-token step stays on the calling thread.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, op,
              ": x must be float32 [rows, columns] with unit stride along a row");
}

}  // namespace

namespace ponder {

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
}

TORCH_LIBRARY_IMPL(ponder, CPU, m) {
  m.impl("head_norms", &ponder::head_norms);
  m.impl("silu_mul", &ponder::silu_mul);
}
