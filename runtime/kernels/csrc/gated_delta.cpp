// ponder's Gated DeltaNet step for the CPU (runtime.kernels.cpu_kernels builds it; runtime.model.recurrent
// uses it): one sequence's tokens through a linear-attention layer past its projections, in float32,
// in transformers' recurrent form, each token after the one before:
//   x      = silu(sum over taps k of window[t + k] * taps[k] (+ bias))       the causal convolution
//   q, k   = per key head: l2-normalised (rsqrt(sum x^2 + 1e-6)); q also / sqrt(dk); v as it is
//   g      = -exp(A_log) * softplus(a_t + dt_bias);  beta = sigmoid(b_t)     per value head
//   S      = S * exp(g);  d = (v - S^T k) * beta;  S = S + k d^T;  out = S^T q   (value head h reads key
//                                                                           head h / (Hv / Hk))
// Every sum runs in one fixed order, and a sequence's tokens are computed from its own inputs and
// state only, so its result never depends on the other sequences of a step or on the thread count
// (value heads are independent and are what threads split).
//
// gated_delta(window [K-1+n, C], taps [K, C], bias [C] or empty, a [n, Hv], b [n, Hv], dt_bias [Hv],
//             A_log [Hv], state [Hv, dk, dv], num_k_heads, head_k_dim, head_v_dim, snapshots [m],
//             core [n, Hv, dv]) -> [final state, the state after each token count in snapshots]:
// writes core; the state given is read, never written. All tensors float32 and contiguous.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

namespace ponder {

namespace {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold

}  // namespace

std::vector<at::Tensor> gated_delta(const at::Tensor& window, const at::Tensor& taps, const at::Tensor& bias,
                                    const at::Tensor& a, const at::Tensor& b, const at::Tensor& dt_bias,
                                    const at::Tensor& a_log, const at::Tensor& state, int64_t num_k_heads,
                                    int64_t head_k_dim, int64_t head_v_dim, at::IntArrayRef snapshots,
                                    at::Tensor& core) {
    const std::array<const at::Tensor*, 8> inputs{&window, &taps, &a, &b, &dt_bias, &a_log, &state, &core};
    for (const at::Tensor* t : inputs) {
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "gated_delta takes contiguous float32");
    }
    const int64_t kernel = taps.size(0), channels = taps.size(1), n = a.size(0), hv = a.size(1);
    const int64_t dk = head_k_dim, dv = head_v_dim, hk = num_k_heads, key_dim = hk * dk;
    TORCH_CHECK(window.size(0) == kernel - 1 + n && window.size(1) == channels, "gated_delta: window shape");
    TORCH_CHECK(channels == 2 * key_dim + hv * dv && hv % hk == 0, "gated_delta: head sizes");
    const bool has_bias = bias.numel() > 0;
    const float* w = window.data_ptr<float>();
    const float* tp = taps.data_ptr<float>();
    const float* bs = has_bias ? bias.data_ptr<float>() : nullptr;

    // Per token: the convolution's output (q and k normalised), the decay and beta of each value head.
    std::vector<float> x(n * channels), decay(n * hv), beta(n * hv);
    const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            float* xt = x.data() + t * channels;
            for (int64_t c = 0; c < channels; ++c) {
                float acc = w[t * channels + c] * tp[c];
                for (int64_t k = 1; k < kernel; ++k) acc += w[(t + k) * channels + c] * tp[k * channels + c];
                if (has_bias) acc += bs[c];
                xt[c] = silu(acc);
            }
            for (int64_t part = 0; part < 2; ++part) {  // q, then k: each key head l2-normalised
                for (int64_t h = 0; h < hk; ++h) {
                    float* v = xt + part * key_dim + h * dk;
                    float sum = 0.0f;
                    for (int64_t i = 0; i < dk; ++i) sum += v[i] * v[i];
                    const float inv = 1.0f / std::sqrt(sum + 1e-6f);
                    for (int64_t i = 0; i < dk; ++i) v[i] = part == 0 ? (v[i] * inv) * q_scale : v[i] * inv;
                }
            }
            const float* at_ = a.data_ptr<float>() + t * hv;
            const float* bt = b.data_ptr<float>() + t * hv;
            for (int64_t h = 0; h < hv; ++h) {
                const float g = -std::exp(a_log.data_ptr<float>()[h]) * softplus(at_[h] + dt_bias.data_ptr<float>()[h]);
                decay[t * hv + h] = std::exp(g);
                beta[t * hv + h] = 1.0f / (1.0f + std::exp(-bt[h]));
            }
        }
    });

    at::Tensor final_state = state.clone();
    std::vector<at::Tensor> result{final_state};
    for (size_t i = 0; i < snapshots.size(); ++i) result.push_back(at::empty_like(state));
    float* s_all = final_state.data_ptr<float>();
    float* out = core.data_ptr<float>();
    const int64_t repeat = hv / hk;
    // Heads split between threads only where each gets kMinWork state updates or more: a decode step's
    // one token is a few microseconds a head, less than waking the other threads (and, on a loaded
    // machine, waiting for them) costs. Which thread computes a head never changes its bits.
    constexpr int64_t kMinWork = 1 << 16;
    const int64_t grain = std::max<int64_t>(1, kMinWork / std::max<int64_t>(1, n * dk * dv));
    at::parallel_for(0, hv, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> memory(dv), delta(dv);
        for (int64_t h = begin; h < end; ++h) {
            float* s = s_all + h * dk * dv;
            const int64_t kh = h / repeat;
            size_t next = 0;
            for (int64_t t = 0; t < n; ++t) {
                const float* xt = x.data() + t * channels;
                const float* q = xt + kh * dk;
                const float* k = xt + key_dim + kh * dk;
                const float* v = xt + 2 * key_dim + h * dv;
                const float dc = decay[t * hv + h], bt = beta[t * hv + h];
                for (int64_t i = 0; i < dk * dv; ++i) s[i] *= dc;
                for (int64_t j = 0; j < dv; ++j) memory[j] = 0.0f;
                for (int64_t i = 0; i < dk; ++i)
                    for (int64_t j = 0; j < dv; ++j) memory[j] += s[i * dv + j] * k[i];
                for (int64_t j = 0; j < dv; ++j) delta[j] = (v[j] - memory[j]) * bt;
                for (int64_t i = 0; i < dk; ++i)
                    for (int64_t j = 0; j < dv; ++j) s[i * dv + j] += k[i] * delta[j];
                float* o = out + (t * hv + h) * dv;
                for (int64_t j = 0; j < dv; ++j) o[j] = 0.0f;
                for (int64_t i = 0; i < dk; ++i)
                    for (int64_t j = 0; j < dv; ++j) o[j] += s[i * dv + j] * q[i];
                while (next < snapshots.size() && snapshots[next] == t + 1) {
                    std::copy(s, s + dk * dv, result[1 + next].data_ptr<float>() + h * dk * dv);
                    ++next;
                }
            }
        }
    });
    return result;
}

}  // namespace ponder

TORCH_LIBRARY_FRAGMENT(ponder, m) {
    m.def("gated_delta(Tensor window, Tensor taps, Tensor bias, Tensor a, Tensor b, Tensor dt_bias, Tensor A_log, "
          "Tensor state, int num_k_heads, int head_k_dim, int head_v_dim, int[] snapshots, Tensor(a!) core) -> Tensor[]");
}
TORCH_LIBRARY_IMPL(ponder, CPU, m) { m.impl("gated_delta", &ponder::gated_delta); }
