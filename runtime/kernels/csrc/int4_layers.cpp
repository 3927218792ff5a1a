// A whole int4 or float decoder stack in one call (runtime.model.decoder uses it for a step whose every
// row is attended by the decode kernel): per layer, exactly the operators of the decoder's int4 loop
// (or, for a layer of float weights, of its float loop), in its order and dtypes, so the residual
// stream comes out with the same bits, without the dozens of Python operator calls a layer otherwise
// costs (most of one stream's decode step on a small model).
//
// int4_layers(hidden [T, E], cos [T, D], sin [T, D], weights, sizes, floats, experts, heads, kv_heads,
//             cache [blocks, layers, 2, KVH, bs, D], slot_rows [2, T, KVH], rows [G], tables [G, W], ctx [G],
//             float_isa)
// returns the residual stream after every layer [T, E]. For layer l of int4 layers:
//   qkv  = q4_linear(hidden; input norm) (+ bias)              [T, (H + 2 KVH) D]
//   q, k = rms_norm over each head (a layer with q and k norms: Qwen3's) in one call over the H + KVH
//          heads: small_ops.cpp's head_norms, as the int4 loop calls it
//   q, k = rotary: x * cos + x rolled by D / 2 * sin           (`sin` with its first half negated;
//          a layer without rotary, SmolLM3's NoPE, keeps them as they are)
//   the keys and values are stored at slot_rows (+ the layer's offset), and every query of `rows`
//   attends to its context with decode_attention, within the layer's sliding window if it has one
//   (the other rows' outputs are 0: padding)
//   hidden = hidden + q4_linear(attention)                     (the o projection)
//   gate, up = q4_linear(hidden; post-attention norm) (+ bias)
//   hidden = hidden + q4_linear(silu(gate) * up)               (the down projection; small_ops.cpp's silu_mul)
// A layer whose MLP is routed over experts (Qwen3-MoE's; its top_k size is not 0) runs instead, over
// int4 experts,
//   hidden = routed_int4(hidden; post-attention norm, residual)
// (routed_int4.cpp: the norm, router, top-k and experts' weighted sum in ponder's own arithmetic, the
// functions runtime.model.experts.RoutedMLP calls), or over float experts
//   hidden = hidden + routed_experts(rms_norm(hidden; post-attention norm))
// (routed_experts.cpp: RoutedMLP's ATen operators), its router's weight and bias in the gate/up slots,
// its experts' 6 tensors each in `experts`, layer after layer.
// A layer whose qkv "codes" are float weights (float32, bfloat16 or float16: FloatLinear's) is the
// float loop's instead: qkv = float_linear(rms_norm(hidden), W, bias), hidden = hidden +
// float_linear(attention, W_o), gate, up likewise, hidden = hidden + float_linear(silu(gate) * up, W_down),
// the norm as runtime.model.decoder._Norm computes it (through ATen, operator for operator) and
// float_linear on `float_isa` (the bits are the same on either instruction set).
// A bfloat16 model (float layers only; hidden, cos, sin and the cache in bfloat16) runs the float
// loop as it runs in bfloat16: each float_linear's input widened and its output rounded to bfloat16
// (FloatLinear.rows), the rotary's two products and their sum each rounded to bfloat16, the
// attention's float32 output rounded to bfloat16, the residual adds and silu in bfloat16 (ATen).
// weights: 17 tensors a layer: input norm, qkv codes, d, m, bias, o codes, d, m, post norm, gate/up
// codes, d, m, bias, down codes, d, m, the head norms' weights [H + KVH, D] (q's for each query head,
// then k's for each KV head) (an empty tensor for a missing m, bias or head norm; d and m empty for a
// float layer); sizes: 9 a layer (qkv, o, gate/up and down out features
// (an expert's, for a routed layer), then gate's, 1 if the layer rotates its queries and keys, its
// sliding window or 0, its experts a token (0: a dense MLP), 1 if their weights are renormalised);
// floats: 4 a layer (the two norms' eps, the attention scale, the head norms' eps).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ponder_kernels.h"

namespace {

constexpr int64_t kTensors = 17, kSizes = 9, kFloats = 4, kExpertTensors = 6;

using ponder::float_rows;
using ponder::present;

// runtime.model.decoder._Norm, operator for operator: on float32 rows, or on bfloat16 ones (computed
// in float32, then rounded back before the weight's product).
at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  const bool wide = hidden.scalar_type() == at::kFloat;
  const at::Tensor x = wide ? hidden : hidden.to(at::kFloat);
  const at::Tensor variance = x.pow(2).mean(-1, /*keepdim=*/true);
  const at::Tensor normed = x * at::rsqrt(variance + eps);
  return weight * (wide ? normed : normed.to(hidden.scalar_type()));
}

// The decoder's rotary arithmetic, element for element: two products, each rounded, then their sum
// (the kernels are built without floating-point contraction, so no fused multiply-add).
inline void rotate(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
  for (int64_t i = half; i < D; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// The same in bfloat16, as ATen computes it on bfloat16 tensors: each product and the sum computed in
// float32 and rounded to bfloat16 (to nearest, ties to even). x, cos and sin hold bfloat16 values.
inline void rotate_bf16(const float* x, const float* cos, const float* sin, int64_t D, c10::BFloat16* out) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const c10::BFloat16 a = x[i] * cos[i];
    const c10::BFloat16 b = x[(i + half) % D] * sin[i];
    out[i] = static_cast<float>(a) + static_cast<float>(b);
  }
}

at::Tensor int4_layers(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                       at::TensorList weights, at::IntArrayRef sizes, at::ArrayRef<double> floats,
                       at::TensorList experts, int64_t H,
                       int64_t KVH, const at::Tensor& cache, const at::Tensor& slot_rows, const at::Tensor& rows,
                       const at::Tensor& tables, const at::Tensor& ctx, int64_t float_isa) {
  const int64_t L = static_cast<int64_t>(weights.size()) / kTensors;
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == L * kTensors &&
              static_cast<int64_t>(sizes.size()) == L * kSizes && static_cast<int64_t>(floats.size()) == L * kFloats,
              "int4_layers: weights, sizes and floats must hold 17, 9 and 4 entries a layer");
  int64_t expert_tensors = 0;
  for (int64_t l = 0; l < L; ++l)
    if (sizes[l * kSizes + 7] != 0) expert_tensors += kExpertTensors * weights[l * kTensors + 9].size(0);
  TORCH_CHECK(static_cast<int64_t>(experts.size()) == expert_tensors,
              "int4_layers: experts must hold 6 tensors an expert of every routed layer");
  const at::Tensor* expert = experts.data();
  const bool narrow = hidden_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(hidden_in.dim() == 2 && (hidden_in.scalar_type() == at::kFloat || narrow),
              "int4_layers: hidden must be float32 or bfloat16 [T, E]");
  TORCH_CHECK(cache.dim() == 6 && cache.scalar_type() == hidden_in.scalar_type() && cache.is_contiguous() &&
              cache.size(1) >= L && cache.size(3) == KVH,
              "int4_layers: cache must be contiguous [blocks, layers, 2, kv_heads, bs, D] in hidden's dtype");
  const int64_t T = hidden_in.size(0), D = cache.size(5), bs = cache.size(4);
  TORCH_CHECK(D % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && cos.numel() == T * D && sin.numel() == T * D,
              "int4_layers: cos and sin must be contiguous float32 [T, head_dim]");
  TORCH_CHECK(slot_rows.scalar_type() == at::kLong && slot_rows.is_contiguous() && slot_rows.numel() == 2 * T * KVH,
              "int4_layers: slot_rows must be contiguous int64 [2, T, kv_heads]");
  const int64_t layer_rows = 2 * KVH * bs, cache_rows = cache.numel() / D;
  const int64_t* slots = slot_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < 2 * T * KVH; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] + (L - 1) * layer_rows < cache_rows, "int4_layers: no cache row ", slots[i]);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kv = narrow ? nullptr : cache.data_ptr<float>();
  c10::BFloat16* kv16 = narrow ? cache.data_ptr<c10::BFloat16>() : nullptr;
  at::Tensor hidden = hidden_in.contiguous();
  at::Tensor queries = at::empty({T, H, D}, hidden.options().dtype(at::kFloat));
  at::Tensor attended = at::empty({T, H, D}, hidden.options().dtype(at::kFloat));
  float* qp = queries.data_ptr<float>();
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * kTensors;
    const int64_t* n = sizes.data() + l * kSizes;
    const double* f = floats.data() + l * kFloats;
    const bool is_float = w[1].is_floating_point();
    TORCH_CHECK(is_float || !narrow, "int4_layers: a bfloat16 stack takes float layers only");
    at::Tensor qkv;
    if (is_float) {
      qkv = float_rows(rms_norm(hidden, w[0], f[0]), w[1], w[4], float_isa);
    } else {
      qkv = ponder::q4_linear(hidden, w[1], w[2], present(w[3]), n[0], w[0], f[0], {}, -1);
      if (w[4].numel() != 0) qkv = qkv + w[4];
    }
    TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D, "int4_layers: layer ", l, "'s qkv has ", qkv.size(1), " outputs");
    // the queries and keys, [T, H + KVH, D]: the decoder's head norms (a layer with them: Qwen3's) in one
    // call over every head (each head's row is normed on its own, so its bits are the per-head call's;
    // w[16] holds q's weight for each query head, then k's for each KV head), or qkv's own columns
    // (an int4 layer's in ponder's own arithmetic, small_ops.cpp, as the int4 loop's)
    const at::Tensor qk = w[16].numel() == 0 ? qkv
                          : is_float ? rms_norm(qkv.narrow(1, 0, (H + KVH) * D).view({T, H + KVH, D}), w[16], f[3])
                                     : ponder::head_norms(qkv, H + KVH, w[16], f[3]);
    const bool rotary = n[5] != 0;
    const at::Tensor qk32 = narrow ? qk.to(at::kFloat) : qk.contiguous();  // bfloat16 values, widened exactly
    const float* x = qk32.data_ptr<float>();
    const int64_t width = qk32.numel() / T, value_width = qkv.size(1);
    // (rows on the threads, about 4096 values each: one row stays on the calling thread)
    at::parallel_for(0, T, std::max<int64_t>(1, 4096 / width), [&](int64_t t0, int64_t t1) {
      std::vector<c10::BFloat16> rotated(narrow ? D : 0);
      for (int64_t t = t0; t < t1; ++t) {
        const float* row = x + t * width;
        for (int64_t h = 0; h < H; ++h) {
          float* q = qp + (t * H + h) * D;
          if (!rotary) {
            std::memcpy(q, row + h * D, D * sizeof(float));
            continue;
          }
          if (!narrow) {
            rotate(row + h * D, cp + t * D, sp + t * D, D, q);
            continue;
          }
          rotate_bf16(row + h * D, cp + t * D, sp + t * D, D, rotated.data());
          for (int64_t i = 0; i < D; ++i) q[i] = static_cast<float>(rotated[i]);
        }
        for (int64_t h = 0; h < KVH; ++h) {
          const int64_t key = (slots[t * KVH + h] + l * layer_rows) * D;
          const int64_t value = (slots[(T + t) * KVH + h] + l * layer_rows) * D;
          if (!narrow) {
            if (rotary) rotate(row + (H + h) * D, cp + t * D, sp + t * D, D, kv + key);
            else std::memcpy(kv + key, row + (H + h) * D, D * sizeof(float));
            std::memcpy(kv + value, qkv.data_ptr<float>() + t * value_width + (H + KVH + h) * D, D * sizeof(float));
            continue;
          }
          const c10::BFloat16* keys = qk.data_ptr<c10::BFloat16>() + t * (qk.numel() / T) + (H + h) * D;
          const c10::BFloat16* values = qkv.data_ptr<c10::BFloat16>() + t * value_width + (H + KVH + h) * D;
          if (rotary) rotate_bf16(row + (H + h) * D, cp + t * D, sp + t * D, D, kv16 + key);
          else std::memcpy(kv16 + key, keys, D * sizeof(c10::BFloat16));
          std::memcpy(kv16 + value, values, D * sizeof(c10::BFloat16));
        }
      }
    });
    attended.zero_();
    ponder::decode_attention(queries, rows, cache, tables, ctx, l, f[2], attended, 0.0, n[6], std::nullopt);
    if (is_float) {
      const at::Tensor out = narrow ? attended.to(at::kBFloat16) : attended;  // attention's output in the model's dtype
      hidden = hidden + float_rows(out.view({T, H * D}), w[5], at::Tensor(), float_isa);
    } else {
      hidden = ponder::q4_linear(attended.view({T, H * D}), w[5], w[6], present(w[7]), n[1], {}, 0.0, hidden, -1);
    }
    if (n[7] != 0) {  // routed experts: int4 ones in ponder's own arithmetic, float ones ATen's
      hidden = expert[0].is_floating_point()
                   ? hidden + ponder::routed_experts(rms_norm(hidden, w[8], f[1]), w[9], w[12], expert, n[7],
                                                     n[8] != 0, n[2], n[3], float_isa)
                   : ponder::routed_int4(hidden, w[8], f[1], w[9], expert, n[7], n[8] != 0, n[2], n[3], float_isa,
                                         /*residual=*/true);
      expert += kExpertTensors * w[9].size(0);
      continue;
    }
    at::Tensor gate_up;
    if (is_float) {
      gate_up = float_rows(rms_norm(hidden, w[8], f[1]), w[9], w[12], float_isa);
    } else {
      gate_up = ponder::q4_linear(hidden, w[9], w[10], present(w[11]), n[2], w[8], f[1], {}, -1);
      if (w[12].numel() != 0) gate_up = gate_up + w[12];
    }
    const int64_t gate = n[4];
    // a float layer's silu through ATen, as the float loop calls it (its vectorized exp is part of the
    // bits; the product is exact elementwise arithmetic); an int4 layer's in ponder's own, as the int4 loop's
    at::Tensor act = is_float ? at::silu(gate_up.narrow(1, 0, gate)).mul_(gate_up.narrow(1, gate, gate_up.size(1) - gate))
                              : ponder::silu_mul(gate_up, gate);
    hidden = is_float ? hidden + float_rows(act, w[13], at::Tensor(), float_isa)
                    : ponder::q4_linear(act, w[13], w[14], present(w[15]), n[3], {}, 0.0, hidden, -1);
  }
  return hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ponder, m) {
  m.def("int4_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, int[] sizes, float[] floats, "
        "Tensor[] experts, int heads, int kv_heads, Tensor(a!) cache, Tensor slot_rows, Tensor rows, Tensor tables, Tensor ctx, "
        "int float_isa=-1) -> Tensor");
}
TORCH_LIBRARY_IMPL(ponder, CPU, m) { m.impl("int4_layers", &int4_layers); }
