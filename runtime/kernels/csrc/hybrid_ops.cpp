// ponder's own arithmetic for Qwen3.5's int4 layers' small operators (runtime.model.qwen35_layers' int4
// loop calls these ops and the hybrid_layers stack kernel the same functions, so the two give the same
// bits), in place of the dozens of ATen operators a layer otherwise dispatches. Each row is computed
// from its own inputs only, in one fixed order (vec_math.h's), so a row's bits never depend on the batch.
//
// gated_norm(x [T Hv, W], z [T, Hv W], weight [W], eps) -> [T, Hv W]: Qwen3.5's gated RMS norm, each
//   W values of x normed (norm_head: (x * r) * w), times silu(z) (silu_mul_row).
// qk_heads(qkv [T, C], heads H, kv_heads KVH, head_dim D, q_scale [D], k_scale [D], q_eps, k_eps,
//   cos [T, R], sin [T, R]) -> [T, H + KVH, D]: the queries (each head's first D of its [q(D), gate(D)]
//   columns) and the keys (the KVH D columns after them) normed by their (1 + w) scales (norm_head), then
//   rotated over their first R features: y[i] = x[i] * cos[i] + x[(i + R / 2) % R] * sin[i] (sin's
//   first half negated), two products, each rounded, then their sum.
// sigmoid_gate(x [T, H D], qkv [T, C], heads H, head_dim D) -> [T, H D]: the attention's output times
//   sigmoid of each head's gate (the D columns after its query in qkv).
// Inputs float32 with unit stride along a row (x of gated_norm and sigmoid_gate, cos and sin contiguous).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ponder_kernels.h"
#include "vec_math.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {

void check_rows(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, op, ": ", name,
              " must be float32 [rows, columns] with unit stride along a row");
}

// Rows a thread takes at least (a one-token step stays on the calling thread).
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

}  // namespace

namespace ponder {

at::Tensor gated_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, double eps) {
  check_rows(x, "gated_norm", "x");
  check_rows(z, "gated_norm", "z");
  const int64_t W = x.size(1), T = z.size(0);
  TORCH_CHECK(x.is_contiguous() && T > 0 && x.size(0) % T == 0 && z.size(1) == x.size(0) / T * W &&
              weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == W,
              "gated_norm: x [T Hv, W], z [T, Hv W] and weight [W]");
  const int64_t heads = x.size(0) / T, stride = z.stride(0);
  at::Tensor out = at::empty({T, heads * W}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* zp = z.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, grain(heads * W), [&](int64_t begin, int64_t end) {
    std::vector<float> normed(W);
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        norm_head(xp + (t * heads + h) * W, wp, W, e, normed.data());
        silu_mul_row(zp + t * stride + h * W, normed.data(), W, yp + (t * heads + h) * W);
      }
  });
  return out;
}

at::Tensor qk_heads(const at::Tensor& qkv, int64_t H, int64_t KVH, int64_t D, const at::Tensor& q_scale,
                    const at::Tensor& k_scale, double q_eps, double k_eps, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(qkv, "qk_heads", "qkv");
  const int64_t T = qkv.size(0), R = cos.numel() / std::max<int64_t>(T, 1), stride = qkv.stride(0);
  TORCH_CHECK(qkv.size(1) >= (2 * H + KVH) * D && R % 2 == 0 && R <= D, "qk_heads: shapes");
  for (const at::Tensor* t : {&q_scale, &k_scale, &cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "qk_heads: contiguous float32 scales, cos, sin");
  TORCH_CHECK(q_scale.numel() == D && k_scale.numel() == D && cos.numel() == T * R && sin.numel() == T * R,
              "qk_heads: scales [D], cos and sin [T, R]");
  at::Tensor out = at::empty({T, H + KVH, D}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float *qs = q_scale.data_ptr<float>(), *ks = k_scale.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t half = R / 2;
  at::parallel_for(0, T, grain((H + KVH) * D), [&](int64_t begin, int64_t end) {
    std::vector<float> normed(D);
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < H + KVH; ++h) {
        const bool query = h < H;
        const float* x = xp + t * stride + (query ? h * 2 * D : 2 * H * D + (h - H) * D);
        norm_head(x, query ? qs : ks, D, static_cast<float>(query ? q_eps : k_eps), normed.data());
        float* y = yp + (t * (H + KVH) + h) * D;
        const float *c = cp + t * R, *s = sp + t * R;
        for (int64_t i = 0; i < R; ++i) {
          const float a = normed[i] * c[i];
          const float b = normed[(i + half) % R] * s[i];
          y[i] = a + b;
        }
        std::copy(normed.begin() + R, normed.end(), y + R);
      }
  });
  return out;
}

at::Tensor sigmoid_gate(const at::Tensor& x, const at::Tensor& qkv, int64_t H, int64_t D) {
  check_rows(x, "sigmoid_gate", "x");
  check_rows(qkv, "sigmoid_gate", "qkv");
  const int64_t T = x.size(0), stride = qkv.stride(0);
  TORCH_CHECK(x.is_contiguous() && x.size(1) == H * D && qkv.size(0) == T && qkv.size(1) >= 2 * H * D,
              "sigmoid_gate: x [T, H D] and qkv [T, >= 2 H D]");
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* gp = qkv.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, T, grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < H; ++h)
        sigmoid_mul_row(xp + (t * H + h) * D, gp + t * stride + h * 2 * D + D, D, yp + (t * H + h) * D);
  });
  return out;
}

}  // namespace ponder

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(ponder, m) {
  m.def("gated_norm(Tensor x, Tensor z, Tensor weight, float eps) -> Tensor");
  m.def("qk_heads(Tensor qkv, int heads, int kv_heads, int head_dim, Tensor q_scale, Tensor k_scale, float q_eps, "
        "float k_eps, Tensor cos, Tensor sin) -> Tensor");
  m.def("sigmoid_gate(Tensor x, Tensor qkv, int heads, int head_dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(ponder, CPU, m) {
  m.impl("gated_norm", &ponder::gated_norm);
  m.impl("qk_heads", &ponder::qk_heads);
  m.impl("sigmoid_gate", &ponder::sigmoid_gate);
}
