// A whole Qwen3.5 int4 layer stack in one call (runtime.model.hybrid_stack uses it for a step whose
// every row is attended by the decode kernel): per layer, exactly the operators of the lean decoder's
// int4 loop (runtime.model.qwen35_layers, `int4 = True`), in its order, the small ones ponder's own
// (hybrid_ops.cpp, small_ops.cpp: the loop calls the same ops), so the residual stream and the recurrent
// states come out with the same bits (tested), without the Python calls a layer otherwise costs (most
// of a small model's decode step).
//
// hybrid_layers(hidden [T, E], cos [T, 1, R], sin [T, 1, R] (contiguous), weights, sizes, floats, dims,
//               cache [blocks, layers, 2, KVH, bs, D], slot_rows [2, T, KVH], rows [G], tables [G, W], ctx [G],
//               conv_states, states, seq_rows [S], lengths [S], snapshots, counts [S])
// returns [the residual stream after every layer, then for each Gated DeltaNet layer in turn: its
// convolution's inputs [T, C] (a view of its projection's output), then gated_delta_steps's outputs
// for the step's S sequences].
// For a Gated DeltaNet layer (kind 0):
//   runs     = q4_linear(hidden; input norm (1 + w)) for each run of fused in-projections
//   mixed, z, b, a = the runs' columns [C | Hv dv | Hv | Hv]                 (views, as split() gives)
//   core     = gated_delta_steps(mixed, a, b; the sequences' states)      (gated_delta.cpp, into zeros)
//   out      = gated_norm(core, z)                                         (hybrid_ops.cpp)
//              (its columns reordered where the layer reads the file's order: index_select)
//   hidden   = hidden + q4_linear(out)                                     (the residual in the kernel)
// For a gated full-attention layer (kind 1):
//   qkv      = q4_linear(hidden; input norm)                               ([q(D), gate(D)] a query head, k, v)
//   qk       = qk_heads(qkv; q and k norms, the partial rotary)           (hybrid_ops.cpp) [T, H + KVH, D]
//   the keys and values are stored at slot_rows (+ the layer's cache offset) and every query of `rows`
//   attends to its context with decode_attention (the other rows' outputs are 0: padding)
//   hidden   = hidden + q4_linear(sigmoid_gate(attention, qkv))            (hybrid_ops.cpp)
// then, either kind, llama's MLP: gate, up = q4_linear(hidden; post norm);
//   hidden = hidden + q4_linear(silu_mul(gate, up))                        (small_ops.cpp).
// weights: 29 tensors a layer: the input norm's scale; four in-projection layers' codes, d and m (a
// delta layer's runs, empty codes for none; an attention layer's qkv first); the out projection's
// codes, d, m; the post norm's scale; gate/up's and down's codes, d, m; a delta layer's gated norm
// weight, its output column order (or empty), conv taps [K, C], conv bias (or empty), dt_bias, A_log
// (an attention layer's q norm scale and k norm scale in the first two, the rest empty).
// sizes: 10 a layer (kind, the four in-projections' outputs (0: none), out, gate/up and down outputs,
// gate's width, the attention layer's place in the cache); floats: 5 a layer (the two norms' eps, the
// gated norm's eps or the attention scale, the q and k norms' eps); dims: H, KVH, D, Hk, dk, Hv, dv.
// conv_states and states: S a delta layer, layer after layer (runtime.model.recurrent's initial states).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "ponder_kernels.h"

namespace ponder {
std::vector<at::Tensor> gated_delta_steps(const at::Tensor& mixed, const at::Tensor& taps, const at::Tensor& bias,
                                          const at::Tensor& a, const at::Tensor& b, const at::Tensor& dt_bias,
                                          const at::Tensor& a_log, at::TensorList conv_states, at::TensorList states,
                                          at::IntArrayRef rows, at::IntArrayRef lengths, at::IntArrayRef snapshots,
                                          at::IntArrayRef counts, int64_t num_k_heads, int64_t head_k_dim,
                                          int64_t head_v_dim, at::Tensor& core);
}

namespace {

constexpr int64_t kTensors = 29, kSizes = 10, kFloats = 5;

using ponder::present;

at::Tensor linear(const at::Tensor& x, const at::Tensor* w, int64_t n, const at::Tensor& norm, double eps,
                  const at::Tensor& residual) {
  return ponder::q4_linear(x, w[0], w[1], present(w[2]), n, present(norm), eps, present(residual), -1);
}

// The columns [start, start + size) of the in-projections' outputs `runs` (their widths `widths`), as a
// view of the one run holding them (a projection never spans two runs).
at::Tensor columns(const std::vector<at::Tensor>& runs, const std::vector<int64_t>& widths, int64_t start, int64_t size) {
  for (size_t r = 0; r < runs.size(); start -= widths[r], ++r)
    if (start < widths[r]) {
      TORCH_CHECK(start + size <= widths[r], "hybrid_layers: a projection spans two fused runs");
      return runs[r].narrow(1, start, size);
    }
  TORCH_CHECK(false, "hybrid_layers: the in-projections' runs are narrower than their projections");
  return at::Tensor();
}

}  // namespace

std::vector<at::Tensor> hybrid_layers(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                                      at::TensorList weights, at::IntArrayRef sizes, at::ArrayRef<double> floats,
                                      at::IntArrayRef dims, const at::Tensor& cache, const at::Tensor& slot_rows,
                                      const at::Tensor& rows, const at::Tensor& tables, const at::Tensor& ctx,
                                      at::TensorList conv_states, at::TensorList states, at::IntArrayRef seq_rows,
                                      at::IntArrayRef lengths, at::IntArrayRef snapshots, at::IntArrayRef counts) {
  const int64_t L = static_cast<int64_t>(weights.size()) / kTensors;
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == L * kTensors &&
              static_cast<int64_t>(sizes.size()) == L * kSizes && static_cast<int64_t>(floats.size()) == L * kFloats &&
              dims.size() == 7, "hybrid_layers: weights, sizes and floats must hold 29, 10 and 5 entries a layer");
  const int64_t H = dims[0], KVH = dims[1], D = dims[2], hk = dims[3], dk = dims[4], hv = dims[5], dv = dims[6];
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.scalar_type() == at::kFloat, "hybrid_layers: hidden must be float32 [T, E]");
  TORCH_CHECK(cache.dim() == 6 && cache.scalar_type() == at::kFloat && cache.is_contiguous() && cache.size(3) == KVH &&
              cache.size(5) == D, "hybrid_layers: cache must be contiguous float32 [blocks, layers, 2, KVH, bs, D]");
  const int64_t T = hidden_in.size(0), bs = cache.size(4), S = static_cast<int64_t>(seq_rows.size());
  TORCH_CHECK(slot_rows.scalar_type() == at::kLong && slot_rows.is_contiguous() && slot_rows.numel() == 2 * T * KVH,
              "hybrid_layers: slot_rows must be contiguous int64 [2, T, kv_heads]");
  int64_t delta_layers = 0;
  for (int64_t l = 0; l < L; ++l) delta_layers += sizes[l * kSizes] == 0;
  TORCH_CHECK(static_cast<int64_t>(conv_states.size()) == delta_layers * S &&
              static_cast<int64_t>(states.size()) == delta_layers * S,
              "hybrid_layers: one conv state and one state a sequence a delta layer");
  const int64_t layer_rows = 2 * KVH * bs, cache_rows = cache.numel() / D;
  const int64_t* slots = slot_rows.data_ptr<int64_t>();
  float* kv = cache.data_ptr<float>();
  const int64_t key_dim = hk * dk, conv_dim = 2 * key_dim + hv * dv;
  at::Tensor hidden = hidden_in.contiguous();
  std::vector<at::Tensor> result{at::Tensor()};
  int64_t delta = 0;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * kTensors;
    const int64_t* n = sizes.data() + l * kSizes;
    const double* f = floats.data() + l * kFloats;
    std::vector<at::Tensor> runs;
    std::vector<int64_t> widths;
    for (int64_t r = 0; r < 4 && n[1 + r] != 0; ++r) {
      runs.push_back(linear(hidden, w + 1 + 3 * r, n[1 + r], w[0], f[0], {}));
      widths.push_back(n[1 + r]);
    }
    TORCH_CHECK(!runs.empty(), "hybrid_layers: layer ", l, " has no in-projection");
    if (n[0] == 0) {  // a Gated DeltaNet layer
      const at::Tensor mixed = columns(runs, widths, 0, conv_dim);
      const at::Tensor z = columns(runs, widths, conv_dim, hv * dv);
      const at::Tensor b = columns(runs, widths, conv_dim + hv * dv, hv);
      const at::Tensor a = columns(runs, widths, conv_dim + hv * dv + hv, hv);
      at::Tensor core = at::zeros({T, hv, dv}, hidden.options());
      std::vector<at::Tensor> ends = ponder::gated_delta_steps(
          mixed, w[25], w[26], a, b, w[27], w[28], conv_states.slice(delta * S, S), states.slice(delta * S, S),
          seq_rows, lengths, snapshots, counts, hk, dk, dv, core);
      result.push_back(mixed);
      result.insert(result.end(), ends.begin(), ends.end());
      ++delta;
      at::Tensor out = ponder::gated_norm(core.view({-1, dv}), z, w[23], f[2]);
      if (w[24].numel() != 0) out = out.index_select(-1, w[24]);
      hidden = linear(out, w + 13, n[5], {}, 0.0, hidden);
    } else {  // a gated full-attention layer
      const at::Tensor qkv = runs[0];
      TORCH_CHECK(qkv.size(1) == (2 * H + 2 * KVH) * D, "hybrid_layers: layer ", l, "'s qkv has ", qkv.size(1), " outputs");
      const at::Tensor qk = ponder::qk_heads(qkv, H, KVH, D, w[23], w[24], f[3], f[4], cos, sin);
      const at::Tensor value = qkv.narrow(1, (2 * H + KVH) * D, KVH * D);
      const int64_t offset = n[9] * layer_rows;
      const float* keys = qk.data_ptr<float>();  // (contiguous [T, H + KVH, D])
      const float* vp = value.data_ptr<float>();
      const int64_t value_stride = value.stride(0);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < KVH; ++h) {
          const int64_t key_row = slots[t * KVH + h] + offset, value_row = slots[(T + t) * KVH + h] + offset;
          TORCH_CHECK(key_row >= 0 && key_row < cache_rows && value_row >= 0 && value_row < cache_rows,
                      "hybrid_layers: no cache row ", key_row);
          std::memcpy(kv + key_row * D, keys + (t * (H + KVH) + H + h) * D, D * sizeof(float));
          std::memcpy(kv + value_row * D, vp + t * value_stride + h * D, D * sizeof(float));
        }
      at::Tensor attended = at::zeros({T, H, D}, hidden.options());
      ponder::decode_attention(qk.narrow(1, 0, H), rows, cache, tables, ctx, n[9], f[2], attended, 0.0, 0,
                               std::nullopt);
      hidden = linear(ponder::sigmoid_gate(attended.view({T, H * D}), qkv, H, D), w + 13, n[5], {}, 0.0, hidden);
    }
    const at::Tensor gate_up = linear(hidden, w + 17, n[6], w[16], f[1], {});
    hidden = linear(ponder::silu_mul(gate_up, n[8]), w + 20, n[7], {}, 0.0, hidden);
  }
  result[0] = hidden;
  return result;
}

TORCH_LIBRARY_FRAGMENT(ponder, m) {
  m.def("hybrid_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, int[] sizes, float[] floats, "
        "int[] dims, Tensor(a!) cache, Tensor slot_rows, Tensor rows, Tensor tables, Tensor ctx, "
        "Tensor[] conv_states, Tensor[] states, int[] seq_rows, int[] lengths, int[] snapshots, int[] counts) -> Tensor[]");
}
TORCH_LIBRARY_IMPL(ponder, CPU, m) { m.impl("hybrid_layers", &hybrid_layers); }
