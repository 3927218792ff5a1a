// A routed MLP block (Qwen3-MoE's) inside the stack kernel (int4_layers.cpp): exactly
// runtime.model.experts.RoutedMLP over kernel layers (`KernelRouter`, `KernelExperts`), operator for
// operator in its order and dtypes, so the same bits (tested), without its Python calls:
//   logits  = float_rows(x, router)                        (the router in ponder's float kernel)
//   weights = softmax(logits) in float32, top-k (renormalised where `norm_topk_prob`), in logits' dtype
//   the (token, expert) entries in (top-k position, token) order, sorted stably by expert; for each
//   expert hit in ascending order, on its rows (gathered, in that order):
//     gate, up = linear(rows, gate_up[e])                  (chunk(2): gate first)
//     h        = linear(silu(gate) * up, down[e]) * entry weight
//     out[tokens] = out[tokens] + h                        (an expert's tokens are distinct)
// starting from zeros, so a token's experts are added in ascending expert order, and every output row
// comes from its own input row only: a row's bits never depend on the batch.
// A linear is ponder's float kernel (FloatLinear.rows) where the expert's weight is float, else its
// int4 block kernel (Int4Linear.rows: float32 rows).
// experts: 6 tensors an expert (gate/up codes or weight, d, m, down codes or weight, d, m; empty where
// absent), as many experts as the router has outputs.
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "ponder_kernels.h"

namespace {

at::Tensor expert_rows(const at::Tensor& x, const at::Tensor* w, int64_t n, int64_t float_isa) {
  if (w[0].is_floating_point()) return ponder::float_rows(x, w[0], at::Tensor(), float_isa);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "routed_experts: int4 experts take float32 rows");
  return ponder::q4_linear(x, w[0], w[1], ponder::present(w[2]), n, {}, 0.0, {}, -1);
}

}  // namespace

namespace ponder {

at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& router, const at::Tensor& router_bias,
                          const at::Tensor* experts, int64_t top_k, bool norm_topk_prob, int64_t gate_up_n,
                          int64_t down_n, int64_t float_isa) {
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
  at::Tensor out = at::zeros_like(x);
  const int64_t gate = gate_up_n / 2;  // chunk(2): gate, up (LayerStack takes an even gate/up only)
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t count = counts[e];
    if (count == 0) continue;
    const at::Tensor* w = experts + 6 * e;
    const at::Tensor gate_up = expert_rows(gathered.narrow(0, start, count), w, gate_up_n, float_isa);
    // silu through ATen, as the Python loop calls it (its vectorized exp is part of the bits)
    const at::Tensor act = at::silu(gate_up.narrow(1, 0, gate)).mul_(gate_up.narrow(1, gate, gate_up_n - gate));
    const at::Tensor h = expert_rows(act, w + 3, down_n, float_isa).mul_(entry_weights.narrow(0, start, count));
    const at::Tensor rows = tokens.narrow(0, start, count);
    out.index_copy_(0, rows, out.index_select(0, rows).add_(h));
    start += count;
  }
  return out;
}

}  // namespace ponder
