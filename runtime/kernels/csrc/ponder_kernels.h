// The kernels' entry points, callable from one another's translation units (int4_layers.cpp runs a
// whole int4 decoder stack through them without a Python round trip per operator).
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace ponder {

// q4_linear.cpp: residual + rms_norm(x; norm_weight, eps) @ W.T for float32 x [R, K] (see there).
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                     const c10::optional<at::Tensor>& m, int64_t N, const c10::optional<at::Tensor>& norm_weight,
                     double eps, const c10::optional<at::Tensor>& residual, int64_t isa);

// float_linear.cpp: x @ W.T + bias for float32 x [R, K], W float32, bfloat16 or float16 (see there).
at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        int64_t isa);

// float_linear.cpp: rows [starts[s], starts[s + 1]) of x (float32, or bfloat16 widened and the output
// rounded back) times weights[s] [N, K], each output float_linear's, in one parallel region.
at::Tensor float_linear_segments(const at::Tensor& x, const std::vector<int64_t>& starts,
                                 const std::vector<const at::Tensor*>& weights, int64_t isa);

// q4_linear.cpp: rows [starts[s], starts[s + 1]) of float32 x times the int4 layer whose codes, d and m
// (empty: none) are layers[s][0..2], N outputs each, each output q4_linear's, in one parallel region.
at::Tensor q4_linear_segments(const at::Tensor& x, const std::vector<int64_t>& starts,
                              const std::vector<const at::Tensor*>& layers, int64_t N);

// float_linear.cpp: FloatLinear.rows (runtime.model.float_layers): float32 rows in and out, or bfloat16
// rows widened and the output rounded back; an empty bias is none.
at::Tensor float_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t isa);

// routed_experts.cpp: runtime.model.experts.RoutedMLP over kernel layers, for normed rows x [T, E] (see there).
at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& router, const at::Tensor& router_bias,
                          const at::Tensor* experts, int64_t top_k, bool norm_topk_prob, int64_t gate_up_n,
                          int64_t down_n, int64_t float_isa);

// routed_int4.cpp: a routed block over int4 experts in ponder's own arithmetic (see there): the whole
// block on rows x (normed first where norm_weight is not empty; x added where `residual`), its routing,
// and its experts' weighted sum for given routes.
at::Tensor routed_int4(const at::Tensor& x, const at::Tensor& norm_weight, double eps, const at::Tensor& router,
                       const at::Tensor* experts, int64_t top_k, bool norm_topk_prob, int64_t gate_up_n,
                       int64_t down_n, int64_t float_isa, bool residual);
std::tuple<at::Tensor, at::Tensor> route_rows(const at::Tensor& logits, int64_t top_k, bool norm_topk_prob);
at::Tensor mix_rows(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& weights,
                    const at::Tensor* experts, int64_t num_experts, int64_t gate_up_n, int64_t down_n);

// small_ops.cpp: the int4 decoder's head norms and silu(gate) * up in ponder's own arithmetic (see there).
at::Tensor head_norms(const at::Tensor& x, int64_t heads, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& x, int64_t gate);

// hybrid_ops.cpp: Qwen3.5's int4 layers' gated norm, head norms with the partial rotary, and output gate
// in ponder's own arithmetic (see there).
at::Tensor gated_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, double eps);
at::Tensor qk_heads(const at::Tensor& qkv, int64_t H, int64_t KVH, int64_t D, const at::Tensor& q_scale,
                    const at::Tensor& k_scale, double q_eps, double k_eps, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor sigmoid_gate(const at::Tensor& x, const at::Tensor& qkv, int64_t H, int64_t D);

// An empty (or undefined) tensor as a missing optional argument.
inline c10::optional<at::Tensor> present(const at::Tensor& t) {
  return !t.defined() || t.numel() == 0 ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(t);
}

// decode_attention.cpp: each query of `rows` attends to its own paged context (see there).
void decode_attention(const at::Tensor& queries, const at::Tensor& rows, const at::Tensor& cache,
                      const at::Tensor& tables, const at::Tensor& ctx, int64_t layer, double scale, at::Tensor out,
                      double softcap, int64_t window, const std::optional<at::Tensor>& sinks);

}  // namespace ponder
