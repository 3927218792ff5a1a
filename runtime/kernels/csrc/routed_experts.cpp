// A routed MLP block (Qwen3-MoE's) over float experts inside the stack kernel (int4_layers.cpp):
// exactly runtime.model.experts.RoutedMLP over float kernel layers (`KernelRouter`, `KernelExperts` of
// FloatLinear), operator for operator in its order and dtypes, so the same bits (tested), without its
// Python calls (int4 experts are routed_int4.cpp's, in ponder's own arithmetic):
//   logits  = float_rows(x, router)                        (the router in ponder's float kernel)
//   weights = softmax(logits) in float32, top-k (renormalised where `norm_topk_prob`), in logits' dtype
//   the (token, expert) entries in (top-k position, token) order, sorted stably by expert; for each
//   expert hit in ascending order, on its rows (gathered, in that order):
//     gate, up = linear(rows, gate_up[e])                  (chunk(2): gate first)
//     h        = linear(silu(gate) * up, down[e]) * entry weight
//     out[tokens] = out[tokens] + h                        (an expert's tokens are distinct)
// starting from zeros, so a token's experts are added in ascending expert order, and every output row
// comes from its own input row only: a row's bits never depend on the batch.
// A linear is ponder's float kernel (FloatLinear.rows). Every hit's gate/up runs in one parallel region
// over the hits' output columns, and so does every hit's down (`float_linear_segments`): each output is
// the one its own kernel call gives, so the same bits in 3 regions a layer (router, gate/up, down)
// where the Python loop opens 1 + 2 an expert hit.
// experts: 6 tensors an expert (gate/up weight, d, m, down weight, d, m; d and m empty), as many
// experts as the router has outputs.
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "ponder_kernels.h"

namespace {

// Every expert hit's linear (layers[s]: its weight) on its rows [starts[s], starts[s + 1]) of x, all in
// one parallel region over the hits' output columns: each output is the one its own kernel call gives.
at::Tensor expert_rows(const at::Tensor& x, const std::vector<int64_t>& starts,
                       const std::vector<const at::Tensor*>& layers, int64_t float_isa) {
  for (const at::Tensor* w : layers) TORCH_CHECK(w[0].is_floating_point(), "routed_experts: float experts only");
  return ponder::float_linear_segments(x, starts, layers, float_isa);
}

}  // namespace

namespace ponder {

at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& router, const at::Tensor& router_bias,
                          const at::Tensor* experts, int64_t top_k, bool norm_topk_prob, int64_t gate_up_n,
                          int64_t /*down_n*/, int64_t float_isa) {
  const int64_t T = x.size(0), E = router.size(0);
  TORCH_CHECK(top_k > 0 && top_k <= E, "routed_experts: top_k ", top_k, " of ", E, " experts");
  // route(): transformers' Qwen3MoeTopKRouter
  const at::Tensor logits = float_rows(x, router, router_bias, float_isa);
  auto [top, indices] = at::topk(at::softmax(logits, -1, at::kFloat), top_k, -1);
  if (norm_topk_prob) top.div_(top.sum(-1, /*keepdim=*/true));
  const at::Tensor weights = top.to(logits.scalar_type());
  // mix_experts(): entry p * T + t is token t's p-th expert
  const at::Tensor flat = indices.t().reshape(-1).contiguous();
  const at::Tensor order = at::argsort(flat, /*stable=*/true, 0, /*descending=*/false);
  const at::Tensor tokens = order.remainder(T);
  const at::Tensor entry_weights = weights.t().reshape(-1).index_select(0, order).unsqueeze(1);
  std::vector<int64_t> counts(E, 0);
  const int64_t* fp = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i) ++counts[fp[i]];
  const at::Tensor gathered = x.index_select(0, tokens);
  std::vector<int64_t> starts{0};
  std::vector<const at::Tensor*> gate_ups, downs;
  for (int64_t e = 0; e < E; ++e) {
    if (counts[e] == 0) continue;
    starts.push_back(starts.back() + counts[e]);
    gate_ups.push_back(experts + 6 * e);
    downs.push_back(experts + 6 * e + 3);
  }
  const at::Tensor gate_up = expert_rows(gathered, starts, gate_ups, float_isa);
  const int64_t gate = gate_up_n / 2;  // chunk(2): gate, up (LayerStack takes an even gate/up only)
  at::Tensor act = at::empty({gate_up.size(0), gate}, gate_up.options());
  for (size_t s = 0; s + 1 < starts.size(); ++s) {
    // silu through ATen on each hit's rows, as the Python loop calls it (its vectorized exp, whose
    // tail and thread split follow the tensor's shape, is part of the bits)
    const at::Tensor rows = gate_up.narrow(0, starts[s], starts[s + 1] - starts[s]);
    at::Tensor out = act.narrow(0, starts[s], rows.size(0));
    at::silu_out(out, rows.narrow(1, 0, gate)).mul_(rows.narrow(1, gate, gate));
  }
  // (elementwise products: the same bits over all hits at once as hit by hit)
  const at::Tensor h = expert_rows(act, starts, downs, float_isa).mul_(entry_weights);
  // out[tokens] = out[tokens] + h, hit after hit: each entry added in order into its token's row
  at::Tensor out = at::zeros_like(x);
  const int64_t width = x.size(1), entries = h.size(0);
  const int64_t* tp = tokens.data_ptr<int64_t>();
  if (x.scalar_type() == at::kFloat) {
    float* op = out.data_ptr<float>();
    const float* hp = h.data_ptr<float>();
    for (int64_t i = 0; i < entries; ++i)
      for (int64_t j = 0; j < width; ++j) op[tp[i] * width + j] += hp[i * width + j];
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "routed_experts: rows must be float32 or bfloat16");
    c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
    const c10::BFloat16* hp = h.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < entries; ++i)  // ATen's bfloat16 add: in float32, rounded to nearest even
      for (int64_t j = 0; j < width; ++j)
        op[tp[i] * width + j] = static_cast<float>(op[tp[i] * width + j]) + static_cast<float>(hp[i * width + j]);
  }
  return out;
}

}  // namespace ponder
