// The kernels' entry points, callable from one another's translation units (int4_layers.cpp runs a
// whole int4 decoder stack through them without a Python round trip per operator).
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace ponder {

// q4_linear.cpp: residual + rms_norm(x; norm_weight, eps) @ W.T for float32 x [R, K] (see there).
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                     const c10::optional<at::Tensor>& m, int64_t N, const c10::optional<at::Tensor>& norm_weight,
                     double eps, const c10::optional<at::Tensor>& residual, int64_t isa);

// float_linear.cpp: x @ W.T + bias for float32 x [R, K], W float32, bfloat16 or float16 (see there).
at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        int64_t isa);

// decode_attention.cpp: each query of `rows` attends to its own paged context (see there).
void decode_attention(const at::Tensor& queries, const at::Tensor& rows, const at::Tensor& cache,
                      const at::Tensor& tables, const at::Tensor& ctx, int64_t layer, double scale, at::Tensor out,
                      double softcap, int64_t window, const std::optional<at::Tensor>& sinks);

}  // namespace ponder
