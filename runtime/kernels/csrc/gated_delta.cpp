// ponder's Gated DeltaNet step for the CPU (runtime.kernels.cpu_kernels builds it; runtime.model.recurrent
// uses it): sequences' tokens through a linear-attention layer past its projections, in float32, in
// transformers' recurrent form, each token of a sequence after the one before:
//   x      = silu(sum over taps k of window[t + k] * taps[k] (+ bias))       the causal convolution
//   q, k   = per key head: l2-normalised (rsqrt(sum x^2 + 1e-6)); q also / sqrt(dk); v as it is
//   g      = -exp(A_log) * softplus(a_t + dt_bias);  beta = sigmoid(b_t)     per value head
//   S      = S * exp(g);  d = (v - S^T k) * beta;  S = S + k d^T;  out = S^T q   (value head h reads key
//                                                                           head h / (Hv / Hk))
// Every sum runs in one fixed order, and a sequence's tokens are computed from its own inputs and
// state only, so its result never depends on the other sequences of a step or on the thread count
// (the (sequence, value head) pairs are independent and are what threads split).
//
// gated_delta_steps(mixed [T, C], taps [K, C], bias [C] or empty, a [T, Hv], b [T, Hv], dt_bias [Hv],
//                   A_log [Hv], conv_states [S][K-1, C], states [S][Hv, dk, dv], rows [S], lengths [S],
//                   snapshots [sum of counts], counts [S], num_k_heads, head_k_dim, head_v_dim,
//                   core [T, Hv, dv]) -> for each sequence s in turn: its last K-1 convolution inputs
// [K-1, C], its final state, then its state after each of its counts[s] token counts in `snapshots`.
// Sequence s is rows rows[s] .. rows[s] + lengths[s] - 1 of mixed, a, b and core, continuing
// conv_states[s] (the inputs of the K-1 tokens before it) and states[s]: one parallel region for the
// convolutions of all of the step's tokens, one over (sequence, value head) for the recurrence, where
// a decode step otherwise made a call and a dozen tensors per sequence and layer. mixed, a and b may be
// column slices of a wider projection's output (unit stride along a row); writes core's rows of the
// sequences; the states given are read, never written.
//
// gated_delta(window [K-1+n, C], taps, bias, a [n, Hv], b [n, Hv], dt_bias, A_log, state [Hv, dk, dv],
//             num_k_heads, head_k_dim, head_v_dim, snapshots [m], core [n, Hv, dv]) -> [final state, the
// state after each token count in snapshots]: one sequence whose window holds its conv state and its
// inputs, computed by the same code. All tensors float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

// AVX2 (every CPU ponder's kernels run on): the loops run eight lanes at a time; each value's arithmetic,
// and each sum's order, is the same whatever the vector width (no contraction, no reassociation)
#pragma GCC push_options
#pragma GCC target("avx2")

namespace ponder {

namespace {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold

// One token through one value head's state S [dk, dv] (`from`, written to `st`; they may be one):
// S = S * decay; memory = S^T k; delta = (v - memory) * beta; S = S + k delta^T; o = S^T q. Two passes
// over S's rows, in order (the decay with memory's sums, the update with o's), each sum over the rows
// in order: the bits of four passes, in half the memory traffic.
inline void delta_token(const float* from, float* st, const float* __restrict__ q, const float* __restrict__ k,
                        const float* __restrict__ v, float decay, float beta, int64_t dk, int64_t dv,
                        float* __restrict__ memory, float* __restrict__ delta, float* __restrict__ o) {
  for (int64_t j = 0; j < dv; ++j) memory[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    const float* __restrict__ in = from + i * dv;
    float* __restrict__ row = st + i * dv;
    const float ki = k[i];
    if (in == row) {
      for (int64_t j = 0; j < dv; ++j) {
        const float value = row[j] * decay;
        row[j] = value;
        memory[j] += value * ki;
      }
    } else {
      for (int64_t j = 0; j < dv; ++j) {
        const float value = in[j] * decay;
        row[j] = value;
        memory[j] += value * ki;
      }
    }
  }
  for (int64_t j = 0; j < dv; ++j) delta[j] = (v[j] - memory[j]) * beta;
  for (int64_t j = 0; j < dv; ++j) o[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    float* __restrict__ row = st + i * dv;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < dv; ++j) {
      const float value = row[j] + ki * delta[j];
      row[j] = value;
      o[j] += value * qi;
    }
  }
}

void check_float_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1, "gated_delta: ", name,
              " must be float32 [rows, columns] with unit stride along a row");
}

}  // namespace

std::vector<at::Tensor> gated_delta_steps(const at::Tensor& mixed, const at::Tensor& taps, const at::Tensor& bias,
                                          const at::Tensor& a, const at::Tensor& b, const at::Tensor& dt_bias,
                                          const at::Tensor& a_log, at::TensorList conv_states, at::TensorList states,
                                          at::IntArrayRef rows, at::IntArrayRef lengths, at::IntArrayRef snapshots,
                                          at::IntArrayRef counts, int64_t num_k_heads, int64_t head_k_dim,
                                          int64_t head_v_dim, at::Tensor& core) {
  check_float_rows(mixed, "mixed");
  check_float_rows(a, "a");
  check_float_rows(b, "b");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&taps, &dt_bias, &a_log, &core})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "gated_delta takes contiguous float32");
  const int64_t S = static_cast<int64_t>(rows.size());
  TORCH_CHECK(static_cast<int64_t>(lengths.size()) == S && static_cast<int64_t>(counts.size()) == S &&
                  static_cast<int64_t>(conv_states.size()) == S && static_cast<int64_t>(states.size()) == S,
              "gated_delta: one row, length, count, conv state and state a sequence");
  const int64_t kernel = taps.size(0), channels = taps.size(1), hv = a.size(1);
  const int64_t dk = head_k_dim, dv = head_v_dim, hk = num_k_heads, key_dim = hk * dk, size = hv * dk * dv;
  TORCH_CHECK(mixed.size(1) == channels && b.size(1) == hv && channels == 2 * key_dim + hv * dv && hv % hk == 0,
              "gated_delta: head sizes");
  TORCH_CHECK(core.dim() == 3 && core.size(1) == hv && core.size(2) == dv, "gated_delta: core must be [T, Hv, dv]");
  // the step's token list: (sequence, token) by a running index; each sequence's first token's offset
  std::vector<int64_t> first(S + 1, 0), snapshot_first(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    const at::Tensor& c = conv_states[s];
    const at::Tensor& st = states[s];
    TORCH_CHECK(c.scalar_type() == at::kFloat && c.is_contiguous() && c.size(0) == kernel - 1 && c.size(1) == channels,
                "gated_delta: a conv state must be contiguous float32 [K-1, C]");
    TORCH_CHECK(st.scalar_type() == at::kFloat && st.is_contiguous() && st.numel() == size,
                "gated_delta: a state must be contiguous float32 [Hv, dk, dv]");
    TORCH_CHECK(lengths[s] >= 0 && rows[s] >= 0 && rows[s] + lengths[s] <= std::min({mixed.size(0), a.size(0),
                                                                                      b.size(0), core.size(0)}),
                "gated_delta: a sequence's rows lie outside the step's");
    first[s + 1] = first[s] + lengths[s];
    snapshot_first[s + 1] = snapshot_first[s] + counts[s];
  }
  TORCH_CHECK(snapshot_first[S] == static_cast<int64_t>(snapshots.size()), "gated_delta: counts must sum to snapshots");
  const int64_t n = first[S];
  const float* tp = taps.data_ptr<float>();
  const float* bs = bias.numel() > 0 ? bias.data_ptr<float>() : nullptr;
  const float* mp = mixed.data_ptr<float>();
  const int64_t mixed_stride = mixed.stride(0);

  // Per token: the convolution's output (q and k normalised), the decay and beta of each value head.
  std::vector<float> x(n * channels), decay(n * hv), beta(n * hv);
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  // (tokens split between threads only where each share gets kMinWork products or more, see below: a
  // decode step's few tokens stay on the calling thread)
  constexpr int64_t kMinWork = 1 << 16;
  const int64_t token_grain = std::max<int64_t>(1, kMinWork / (channels * kernel));
  at::parallel_for(0, n, token_grain, [&](int64_t token_begin, int64_t token_end) {
    std::vector<const float*> inputs(kernel);  // window row t + k: the conv state's, then mixed's rows
    for (int64_t token = token_begin; token < token_end; ++token) {
      const int64_t s = std::upper_bound(first.begin(), first.end(), token) - first.begin() - 1;
      const int64_t t = token - first[s];
      const float* conv = conv_states[s].data_ptr<float>();
      {
        for (int64_t k = 0; k < kernel; ++k) {
          const int64_t r = t + k;
          inputs[k] = r < kernel - 1 ? conv + r * channels : mp + (rows[s] + r - (kernel - 1)) * mixed_stride;
        }
        float* xt = x.data() + (first[s] + t) * channels;
        // each channel's taps summed in order, tap after tap over all channels (eight lanes at a time)
        for (int64_t c = 0; c < channels; ++c) xt[c] = inputs[0][c] * tp[c];
        for (int64_t k = 1; k < kernel; ++k) {
          const float* __restrict__ in = inputs[k];
          const float* __restrict__ tap = tp + k * channels;
          for (int64_t c = 0; c < channels; ++c) xt[c] += in[c] * tap[c];
        }
        if (bs != nullptr)
          for (int64_t c = 0; c < channels; ++c) xt[c] += bs[c];
        for (int64_t c = 0; c < channels; ++c) xt[c] = silu(xt[c]);
        for (int64_t part = 0; part < 2; ++part) {  // q, then k: each key head l2-normalised
          for (int64_t h = 0; h < hk; ++h) {
            float* v = xt + part * key_dim + h * dk;
            float sum = 0.0f;
            for (int64_t i = 0; i < dk; ++i) sum += v[i] * v[i];
            const float inv = 1.0f / std::sqrt(sum + 1e-6f);
            for (int64_t i = 0; i < dk; ++i) v[i] = part == 0 ? (v[i] * inv) * q_scale : v[i] * inv;
          }
        }
        const float* at_ = a.data_ptr<float>() + (rows[s] + t) * a.stride(0);
        const float* bt = b.data_ptr<float>() + (rows[s] + t) * b.stride(0);
        for (int64_t h = 0; h < hv; ++h) {
          const float g = -std::exp(a_log.data_ptr<float>()[h]) * softplus(at_[h] + dt_bias.data_ptr<float>()[h]);
          decay[(first[s] + t) * hv + h] = std::exp(g);
          beta[(first[s] + t) * hv + h] = 1.0f / (1.0f + std::exp(-bt[h]));
        }
      }
    }
  });

  // each sequence's outputs: its last K-1 convolution inputs, its final state, its snapshots
  std::vector<at::Tensor> result;
  std::vector<float*> finals(S);
  std::vector<float*> taken(snapshots.size());
  for (int64_t s = 0; s < S; ++s) {
    at::Tensor conv = at::empty({kernel - 1, channels}, taps.options());
    for (int64_t r = 0; r < kernel - 1; ++r) {  // window rows length .. length + K - 2
      const int64_t w = lengths[s] + r;
      const float* src = w < kernel - 1 ? conv_states[s].data_ptr<float>() + w * channels
                                        : mp + (rows[s] + w - (kernel - 1)) * mixed_stride;
      std::copy(src, src + channels, conv.data_ptr<float>() + r * channels);
    }
    result.push_back(conv);
    result.push_back(at::empty_like(states[s]));
    finals[s] = result.back().data_ptr<float>();
    for (int64_t i = snapshot_first[s]; i < snapshot_first[s + 1]; ++i) {
      result.push_back(at::empty_like(states[s]));
      taken[i] = result.back().data_ptr<float>();
    }
  }
  float* out = core.data_ptr<float>();
  const int64_t repeat = hv / hk;
  // (sequence, value head) pairs split between threads only where each share gets kMinWork state
  // updates or more: one sequence's decode token is a few microseconds a head, less than waking the
  // other threads (and, on a loaded machine, waiting for them) costs. Which thread computes a pair
  // never changes its bits.
  const int64_t per_pair = std::max<int64_t>(1, n * dk * dv / std::max<int64_t>(1, S));
  const int64_t grain = std::max<int64_t>(1, kMinWork / per_pair);
  at::parallel_for(0, S * hv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> memory(dv), delta(dv);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t s = pair / hv, h = pair % hv, kh = h / repeat;
      const float* initial = states[s].data_ptr<float>() + h * dk * dv;
      float* st = finals[s] + h * dk * dv;
      int64_t next = snapshot_first[s];
      for (int64_t t = 0; t < lengths[s]; ++t) {
        const int64_t token = first[s] + t;
        const float* xt = x.data() + token * channels;
        const float* q = xt + kh * dk;
        const float* k = xt + key_dim + kh * dk;
        const float* v = xt + 2 * key_dim + h * dv;
        const float dc = decay[token * hv + h], bt = beta[token * hv + h];
        const float* from = t == 0 ? initial : st;  // (the state given is read, never written)
        delta_token(from, st, q, k, v, dc, bt, dk, dv, memory.data(), delta.data(),
                    out + ((rows[s] + t) * hv + h) * dv);
        while (next < snapshot_first[s + 1] && snapshots[next] == t + 1) {
          std::copy(st, st + dk * dv, taken[next] + h * dk * dv);
          ++next;
        }
      }
      if (lengths[s] == 0) std::copy(initial, initial + dk * dv, st);
    }
  });
  return result;
}

std::vector<at::Tensor> gated_delta(const at::Tensor& window, const at::Tensor& taps, const at::Tensor& bias,
                                    const at::Tensor& a, const at::Tensor& b, const at::Tensor& dt_bias,
                                    const at::Tensor& a_log, const at::Tensor& state, int64_t num_k_heads,
                                    int64_t head_k_dim, int64_t head_v_dim, at::IntArrayRef snapshots,
                                    at::Tensor& core) {
  TORCH_CHECK(window.scalar_type() == at::kFloat && window.is_contiguous(), "gated_delta takes contiguous float32");
  const int64_t kernel = taps.size(0), n = a.size(0);
  TORCH_CHECK(window.size(0) == kernel - 1 + n && window.size(1) == taps.size(1), "gated_delta: window shape");
  const at::Tensor conv = window.narrow(0, 0, kernel - 1).contiguous();
  std::vector<at::Tensor> out = gated_delta_steps(
      window.narrow(0, kernel - 1, n), taps, bias, a, b, dt_bias, a_log, {conv}, {state}, {0}, {n}, snapshots,
      {static_cast<int64_t>(snapshots.size())}, num_k_heads, head_k_dim, head_v_dim, core);
  out.erase(out.begin());  // (the caller keeps its own window)
  return out;
}

}  // namespace ponder

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(ponder, m) {
  m.def("gated_delta(Tensor window, Tensor taps, Tensor bias, Tensor a, Tensor b, Tensor dt_bias, Tensor A_log, "
        "Tensor state, int num_k_heads, int head_k_dim, int head_v_dim, int[] snapshots, Tensor(a!) core) -> Tensor[]");
  m.def("gated_delta_steps(Tensor mixed, Tensor taps, Tensor bias, Tensor a, Tensor b, Tensor dt_bias, "
        "Tensor A_log, Tensor[] conv_states, Tensor[] states, int[] rows, int[] lengths, int[] snapshots, "
        "int[] counts, int num_k_heads, int head_k_dim, int head_v_dim, Tensor(a!) core) -> Tensor[]");
}
TORCH_LIBRARY_IMPL(ponder, CPU, m) {
  m.impl("gated_delta", &ponder::gated_delta);
  m.impl("gated_delta_steps", &ponder::gated_delta_steps);
}
