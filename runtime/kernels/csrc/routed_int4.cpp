// A routed MLP block over int4 experts (Qwen3-MoE's, its experts SiLU(gate) * up) in ponder's own
// fixed-order arithmetic: the stack kernel (int4_layers.cpp) and runtime.model.experts (RoutedMLP, and
// KernelRouter / KernelExperts under transformers' forward) call these same functions, so one set of
// bits, without ATen's operators inside the layer (their dispatch cost a one-token step more than
// their arithmetic: about 40 of them a layer).
//
// routed_int4(x [T, H], norm_weight [H] or empty, eps, router [E, H], experts, top_k, norm_topk_prob,
//             gate_up_n, down_n, float_isa, residual) -> [T, H]:
//   n       = x's RMS norm where norm_weight is given (else x):  n = (x * r) * w,
//             r = 1 / sqrt(s / H + eps), s = sum of x^2 in eight lanes over the row in order, the lanes
//             added in one fixed tree, then the tail (H % 8) in order (vec_math.h's norm_head)
//   logits  = float_rows(n, router)                              (ponder's float kernel: FloatLinear.rows)
//   weights, indices = route_rows(logits)                        (below)
//   out     = mix_rows(n, indices, weights)                      (below), plus x where `residual`.
// route_rows(logits [T, E] float32, top_k, norm_topk_prob) -> (weights [T, k] float32, indices [T, k] int64):
//   p = softmax(logits): m = the row's max, e_i = exp(l_i - m) (vec_math.h's), s = the e_i added in
//   index order, p_i = e_i / s; the k largest p in descending order (ties: the lower index first);
//   renormalised where norm_topk_prob: w_j = p_j / (p_1 + ... + p_k, added in that order).
// mix_rows(n [T, H], indices, weights, experts) -> [T, H]: the (token, expert) entries grouped by expert
//   (ascending; within an expert, by token); for every expert hit, its rows through its gate/up
//   (q4_linear_segments: every hit in one parallel region), silu(gate) * up (small_ops.cpp's silu_mul),
//   its down; each token's row starts from zeros and adds weight * down row for its experts in
//   ascending expert order (each product rounded, then the add).
// Every output row comes from its own input row only: a row's bits never depend on the batch or the
// threads. experts: 6 tensors an expert (gate/up codes, d, m, down codes, d, m; m empty where absent).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "ponder_kernels.h"
#include "vec_math.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {

constexpr int64_t kExpertTensors = 6;

// exp(v) for v <= 0, lane for lane as vec_math.h's exp_nonpositive computes it
void exp_row(float* v, int64_t n) {
  const int64_t full = n - n % 8;
  for (int64_t i = 0; i < full; i += 8) _mm256_storeu_ps(v + i, ponder::exp_nonpositive(_mm256_loadu_ps(v + i)));
  for (int64_t i = full; i < n; ++i) v[i] = _mm256_cvtss_f32(ponder::exp_nonpositive(_mm256_set1_ps(v[i])));
}

void route_row(const float* logits, int64_t E, int64_t k, bool renormalise, float* p, float* weight, int64_t* index) {
  float m = logits[0];
  for (int64_t i = 1; i < E; ++i) m = logits[i] > m ? logits[i] : m;
  for (int64_t i = 0; i < E; ++i) p[i] = logits[i] - m;
  exp_row(p, E);
  float s = 0.0f;
  for (int64_t i = 0; i < E; ++i) s += p[i];
  for (int64_t i = 0; i < E; ++i) p[i] = p[i] / s;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t i = 0; i < E; ++i) {
      bool taken = false;
      for (int64_t q = 0; q < j; ++q) taken = taken || index[q] == i;
      if (!taken && (best < 0 || p[i] > p[best])) best = i;
    }
    index[j] = best;
    weight[j] = p[best];
  }
  if (!renormalise) return;
  float total = 0.0f;
  for (int64_t j = 0; j < k; ++j) total += weight[j];
  for (int64_t j = 0; j < k; ++j) weight[j] = weight[j] / total;
}

void check_experts(at::TensorList experts, int64_t E) {
  TORCH_CHECK(static_cast<int64_t>(experts.size()) == kExpertTensors * E,
              "routed_int4: experts must hold 6 tensors an expert, for each of the router's ", E, " outputs");
  for (int64_t i = 0; i < static_cast<int64_t>(experts.size()); i += 3)
    TORCH_CHECK(!experts[i].is_floating_point(), "routed_int4: the experts must be int4 kernel layers");
}

// The experts' weighted sum (mix_rows) of rows xp [T, H] routed to ip / wp [T, k]; `residual` (or null)
// added after, element by element.
at::Tensor mix(const float* xp, int64_t T, int64_t H, const int64_t* ip, const float* wp, int64_t k,
               const at::Tensor* experts, int64_t num_experts, int64_t gate_up_n, int64_t down_n,
               const at::TensorOptions& options, const float* residual) {
  TORCH_CHECK(down_n == H && gate_up_n % 2 == 0, "routed_int4: an expert's down must give the hidden size");
  std::vector<int64_t> counts(num_experts, 0);
  for (int64_t i = 0; i < T * k; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < num_experts, "routed_int4: no expert ", ip[i]);
    ++counts[ip[i]];
  }
  std::vector<int64_t> starts{0}, next(num_experts, 0);
  std::vector<const at::Tensor*> gate_ups, downs;
  for (int64_t e = 0; e < num_experts; ++e) {
    next[e] = starts.back();
    if (counts[e] == 0) continue;
    starts.push_back(starts.back() + counts[e]);
    gate_ups.push_back(experts + kExpertTensors * e);
    downs.push_back(experts + kExpertTensors * e + 3);
  }
  // the entries grouped by expert, by token within one: entry i is token tokens[i]'s, weighted entry_weights[i]
  const int64_t entries = T * k;
  std::vector<int64_t> tokens(entries);
  std::vector<float> entry_weights(entries);
  at::Tensor gathered = at::empty({entries, H}, options);
  float* gp = gathered.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = next[ip[t * k + j]]++;
      tokens[i] = t;
      entry_weights[i] = wp[t * k + j];
      std::memcpy(gp + i * H, xp + t * H, H * sizeof(float));
    }
  const at::Tensor gate_up = ponder::q4_linear_segments(gathered, starts, gate_ups, gate_up_n);
  const at::Tensor h = ponder::q4_linear_segments(ponder::silu_mul(gate_up, gate_up_n / 2), starts, downs, down_n);
  at::Tensor out = at::empty({T, H}, options);
  float* op = out.data_ptr<float>();
  std::fill(op, op + T * H, 0.0f);
  const float* hp = h.data_ptr<float>();
  for (int64_t i = 0; i < entries; ++i) {  // in ascending expert order
    float* row = op + tokens[i] * H;
    const float* add = hp + i * H;
    const float w = entry_weights[i];
    for (int64_t c = 0; c < H; ++c) row[c] += w * add[c];
  }
  if (residual != nullptr)  // x + out, each element's float32 add (as ATen's add computes it)
    for (int64_t i = 0; i < T * H; ++i) op[i] = residual[i] + op[i];
  return out;
}

}  // namespace

namespace ponder {

std::tuple<at::Tensor, at::Tensor> route_rows(const at::Tensor& logits, int64_t top_k, bool norm_topk_prob) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "route_rows: logits must be contiguous float32 [rows, experts]");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(top_k > 0 && top_k <= E, "route_rows: top_k ", top_k, " of ", E, " experts");
  at::Tensor weights = at::empty({T, top_k}, logits.options());
  at::Tensor indices = at::empty({T, top_k}, logits.options().dtype(at::kLong));
  std::vector<float> p(E);
  const float* lp = logits.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    route_row(lp + t * E, E, top_k, norm_topk_prob, p.data(), weights.data_ptr<float>() + t * top_k,
              indices.data_ptr<int64_t>() + t * top_k);
  return {weights, indices};
}

at::Tensor mix_rows(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& weights,
                    const at::Tensor* experts, int64_t num_experts, int64_t gate_up_n, int64_t down_n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "routed_int4: rows must be contiguous float32 [rows, hidden]");
  const int64_t T = x.size(0), H = x.size(1), k = indices.size(1);
  TORCH_CHECK(indices.scalar_type() == at::kLong && indices.is_contiguous() && indices.size(0) == T &&
                  weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.sizes() == indices.sizes(),
              "routed_int4: indices (int64) and weights (float32) must be contiguous [rows, top_k]");
  return mix(x.data_ptr<float>(), T, H, indices.data_ptr<int64_t>(), weights.data_ptr<float>(), k, experts,
             num_experts, gate_up_n, down_n, x.options(), nullptr);
}

at::Tensor routed_int4(const at::Tensor& x, const at::Tensor& norm_weight, double eps, const at::Tensor& router,
                       const at::Tensor* experts, int64_t top_k, bool norm_topk_prob, int64_t gate_up_n,
                       int64_t down_n, int64_t float_isa, bool residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "routed_int4: rows must be float32 [rows, hidden]");
  const at::Tensor rows = x.contiguous();
  const int64_t T = rows.size(0), H = rows.size(1), E = router.size(0);
  TORCH_CHECK(top_k > 0 && top_k <= E, "route_rows: top_k ", top_k, " of ", E, " experts");
  // (the block's own buffers in vectors: no ATen allocation for them)
  std::vector<float> normed(norm_weight.numel() != 0 ? T * H : 0), p(E), weights(T * top_k);
  std::vector<int64_t> indices(T * top_k);
  const float* np = rows.data_ptr<float>();
  if (norm_weight.numel() != 0) {
    TORCH_CHECK(norm_weight.scalar_type() == at::kFloat && norm_weight.is_contiguous() && norm_weight.numel() == H,
                "routed_int4: the norm's weight must be contiguous float32 [hidden]");
    for (int64_t t = 0; t < T; ++t)
      ponder::norm_head(np + t * H, norm_weight.data_ptr<float>(), H, static_cast<float>(eps), normed.data() + t * H);
    np = normed.data();
  }
  const at::Tensor logits =
      float_rows(at::from_blob(const_cast<float*>(np), {T, H}, rows.options()), router, at::Tensor(), float_isa)
          .contiguous();
  for (int64_t t = 0; t < T; ++t)
    route_row(logits.data_ptr<float>() + t * E, E, top_k, norm_topk_prob, p.data(), weights.data() + t * top_k,
              indices.data() + t * top_k);
  return mix(np, T, H, indices.data(), weights.data(), top_k, experts, E, gate_up_n, down_n, rows.options(),
             residual ? rows.data_ptr<float>() : nullptr);
}

}  // namespace ponder

#pragma GCC pop_options

namespace {

at::Tensor routed_int4_op(const at::Tensor& x, const c10::optional<at::Tensor>& norm_weight, double eps,
                          const at::Tensor& router, at::TensorList experts, int64_t top_k, bool norm_topk_prob,
                          int64_t gate_up_n, int64_t down_n, int64_t float_isa, bool residual) {
  check_experts(experts, router.size(0));
  return ponder::routed_int4(x, norm_weight.value_or(at::Tensor()), eps, router, experts.data(), top_k,
                             norm_topk_prob, gate_up_n, down_n, float_isa, residual);
}

at::Tensor mix_int4_op(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& weights,
                       at::TensorList experts, int64_t gate_up_n, int64_t down_n) {
  check_experts(experts, static_cast<int64_t>(experts.size()) / kExpertTensors);
  return ponder::mix_rows(x.contiguous(), indices.contiguous(), weights.contiguous(), experts.data(),
                          static_cast<int64_t>(experts.size()) / kExpertTensors, gate_up_n, down_n);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ponder, m) {
  m.def("routed_int4(Tensor x, Tensor? norm_weight, float eps, Tensor router, Tensor[] experts, int top_k, "
        "bool norm_topk_prob, int gate_up_n, int down_n, int float_isa, bool residual) -> Tensor");
  m.def("route_rows(Tensor logits, int top_k, bool norm_topk_prob) -> (Tensor, Tensor)");
  m.def("mix_int4(Tensor x, Tensor indices, Tensor weights, Tensor[] experts, int gate_up_n, int down_n) -> Tensor");
}
TORCH_LIBRARY_IMPL(ponder, CPU, m) {
  m.impl("routed_int4", &routed_int4_op);
  m.impl("route_rows", &ponder::route_rows);
  m.impl("mix_int4", &mix_int4_op);
}
