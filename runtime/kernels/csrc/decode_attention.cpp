// ponder's decode attention for the CPU (runtime.kernels.cpu_kernels builds it; runtime.model.attention uses it).
//
// Each query attends to exactly its own context, read straight from its paged blocks: no window is
// gathered, no position is padded. For query g and KV head h, with the query heads that share h
// (grouped-query attention), in float32 and in a fixed order:
//   s_j = (q . k_j) * scale                         j < ctx[g], k_j at block tables[g, j / bs], offset j % bs
//   s_j = softcap * tanh(s_j / softcap)              with soft-capping (Gemma 2), softcap > 0
//                                                  with a sliding window, only j >= ctx[g] - window
//   w_j = exp(s_j - max s) / sum of those exps     (exp: a polynomial, the same bits on every CPU)
//                                                  with sinks (gpt-oss), the head's sink joins the max
//                                                  and adds its exp to the sum; it weighs no value
//   out = sum over j, in order, of w_j * v_j
// A query's result depends on its own query, context and cache only, so it never depends on the
// batch, the thread count or what else the step holds. A bfloat16 cache's keys and values are
// widened to float32 as they are read (exactly), so it gives the bits a float32 cache of the same
// values gives.
//
// decode_attention(queries [T, H, D], rows [G], cache [blocks, layers, 2, KVH, bs, D], tables [G, W],
//                  ctx [G], layer, scale, out [T, H, D], softcap, window, sinks [H]) writes out[rows[g]] for
// every g; softcap 0, window 0 and sinks None mean none. queries and out are float32, the cache float32 or bfloat16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "ponder_kernels.h"
#include "vec_math.h"

#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using ponder::exp_nonpositive;

#pragma GCC push_options
#pragma GCC target("avx2,fma")

// Eight cache elements as float32: a float32 cache's as they are, a bfloat16 cache's widened
// (its 16 bits are a float32's high half, so exactly).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline float hsum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

// hsum of four vectors at once, each summed in hsum's order: (lo + hi), then lanes (0 + 2) and
// (1 + 3), then those two. Float addition commutes exactly, so each result has hsum's bits.
inline void hsum4(__m256 a, __m256 b, __m256 c, __m256 d, float* out) {
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
  // Per 128-bit lane: [x0 + x2, x1 + x3, y0 + y2, y1 + y3] for (x, y) = (a, c) low and (b, d) high.
  const __m256 pairs = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 sums = _mm256_hadd_ps(pairs, pairs);  // low lane [a, c, a, c], high lane [b, d, b, d]
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sums);
  out[0] = lanes[0];
  out[1] = lanes[4];
  out[2] = lanes[1];
  out[3] = lanes[5];
}

struct Layout {
  int64_t H, KVH, D, bs, W;
  float softcap;   // 0: none
  int64_t window;  // 0: the whole context
  int64_t q_stride;      // floats from one query row to the next
  int64_t block_stride;  // floats from one block to the next
  int64_t layer_offset;  // floats from a block's start to this layer's keys
};

// out[i] = sum over j, in order, of w[i][j] * v_j for the S query heads of one KV head, N chunks
// of 8 at a time (the head's D / 8 chunks in passes of N; a last pass may hold fewer): each value
// chunk is loaded once for all S heads. Every output element is the same FMA chain over the
// positions as one head at a time would compute, so the bits are the same.
template <int S, int N, class KV>
void weighted_values(const Layout& s, const KV* values, const int64_t* table, int64_t first, int64_t ctx,
                     const float* weights, float* out) {
  const int64_t D = s.D, chunks = D / 8;
  for (int64_t c0 = 0; c0 < chunks; c0 += N) {
    const int64_t n = std::min<int64_t>(N, chunks - c0);
    __m256 acc[S][N];
    for (int i = 0; i < S; ++i)
      for (int c = 0; c < N; ++c) acc[i][c] = _mm256_setzero_ps();
    const auto run_positions = [&](auto full) {
      for (int64_t j = 0; j < ctx;) {
        const int64_t p = first + j, offset = p % s.bs, run = std::min(s.bs - offset, ctx - j);
        const KV* block = values + table[p / s.bs] * s.block_stride + offset * D + 8 * c0;
        for (int64_t t = 0; t < run; ++t, ++j) {
          const KV* v = block + t * D;
          __m256 w[S];
          for (int i = 0; i < S; ++i) w[i] = _mm256_set1_ps(weights[i * ctx + j]);
          const int64_t m = full ? N : n;  // a constant N where the pass is full
          for (int64_t c = 0; c < m; ++c) {
            const __m256 vc = load8(v + 8 * c);
            for (int i = 0; i < S; ++i) acc[i][c] = _mm256_fmadd_ps(w[i], vc, acc[i][c]);
          }
        }
      }
    };
    if (n == N)
      run_positions(std::true_type{});
    else
      run_positions(std::false_type{});
    for (int i = 0; i < S; ++i)
      for (int64_t c = 0; c < n; ++c) _mm256_storeu_ps(out + i * D + 8 * (c0 + c), acc[i][c]);
  }
}

// The scores of keys 0 .. 4 * (ctx / 4) - 1 for query heads [0, S) (or, with `heads` > S, for S
// heads at a time up to `heads`), four keys at a time; returns the first key left for one at a time.
template <int S, class Key, class Store>
int64_t score_keys(const Layout& s, const float* qh, int64_t ctx, const Key& key, const Store& store,
                   int64_t heads = S) {
  const int64_t D = s.D, chunks = D / 8;
  int64_t j = 0;
  for (; j + 4 <= ctx; j += 4) {
    const auto k = std::array{key(j), key(j + 1), key(j + 2), key(j + 3)};
    for (int64_t i0 = 0; i0 < heads; i0 += S) {
      __m256 acc[S][4];
      for (int i = 0; i < S; ++i)
        for (int t = 0; t < 4; ++t) acc[i][t] = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        __m256 qc[S];
        for (int i = 0; i < S; ++i) qc[i] = _mm256_loadu_ps(qh + (i0 + i) * D + 8 * c);
        for (int t = 0; t < 4; ++t) {
          const __m256 kc = load8(k[t] + 8 * c);
          for (int i = 0; i < S; ++i) acc[i][t] = _mm256_fmadd_ps(qc[i], kc, acc[i][t]);
        }
      }
      for (int i = 0; i < S; ++i) {
        alignas(16) float dots[4];
        hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], dots);
        for (int64_t t = 0; t < 4; ++t) store(i0 + i, j + t, dots[t]);
      }
    }
  }
  return j;
}

// One query and one KV head: the `shared` query heads of that KV head. `scores` has room for
// shared * ctx floats. With a window, the context is its last `window` positions: `first` on.
template <class KV>
void attend_head(const Layout& s, const float* q, const KV* cache, const int64_t* table, int64_t full_ctx,
                 int64_t kv_head, float scale, float* out, float* scores, const float* sinks) {
  const int64_t shared = s.H / s.KVH, D = s.D, chunks = D / 8;
  const int64_t head_offset = kv_head * s.bs * D, value_offset = s.KVH * s.bs * D;
  const int64_t first = s.window > 0 && full_ctx > s.window ? full_ctx - s.window : 0;
  const int64_t ctx = full_ctx - first;
  const float* qh = q + kv_head * shared * D;
  const auto key = [&](int64_t j) {
    const int64_t p = first + j;
    return cache + table[p / s.bs] * s.block_stride + s.layer_offset + head_offset + (p % s.bs) * D;
  };
  const auto store = [&](int64_t i, int64_t j, float dot) {
    const float score = dot * scale;
    scores[i * ctx + j] = s.softcap > 0 ? std::tanh(score / s.softcap) * s.softcap : score;
  };
  // Four keys at a time, for all the query heads of this KV head together (up to four): twelve
  // independent FMA chains for three heads, so the FMA units never wait on one. Every score is
  // still one FMA chain over the chunks in order and the same reduction (hsum4), so its bits are
  // those of one score at a time.
  int64_t j = 0;
  switch (shared) {
    case 1: j = score_keys<1>(s, qh, ctx, key, store); break;
    case 2: j = score_keys<2>(s, qh, ctx, key, store); break;
    case 3: j = score_keys<3>(s, qh, ctx, key, store); break;
    case 4: j = score_keys<4>(s, qh, ctx, key, store); break;
    default: j = score_keys<1>(s, qh, ctx, key, store, shared); break;
  }
  for (; j < ctx; ++j) {
    const KV* k = key(j);
    for (int64_t i = 0; i < shared; ++i) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i * D + 8 * c), load8(k + 8 * c), acc);
      store(i, j, hsum(acc));
    }
  }
  for (int64_t i = 0; i < shared; ++i) {
    float* si = scores + i * ctx;
    float top = si[0];
    for (int64_t j = 1; j < ctx; ++j) top = std::max(top, si[j]);
    const float* sink = sinks != nullptr ? sinks + kv_head * shared + i : nullptr;
    if (sink != nullptr) top = std::max(top, *sink);
    const __m256 top8 = _mm256_set1_ps(top);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= ctx; j += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(si + j), top8));
      _mm256_storeu_ps(si + j, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    if (j < ctx) {  // the tail through a padded vector, so every exp is the same polynomial
      alignas(32) float tail[8];
      for (int64_t t = 0; t < 8; ++t) tail[t] = j + t < ctx ? si[j + t] - top : -100.0f;
      const __m256 e = exp_nonpositive(_mm256_load_ps(tail));
      _mm256_store_ps(tail, e);
      for (int64_t t = 0; j + t < ctx; ++t) si[j + t] = tail[t];
      sum8 = _mm256_add_ps(sum8, e);  // the padding's exps are 0
    }
    float sum = hsum(sum8);
    if (sink != nullptr) {  // the sink's exp, through the same polynomial (its other lanes' exps are 0)
      alignas(32) float lane[8] = {*sink - top, -100.0f, -100.0f, -100.0f, -100.0f, -100.0f, -100.0f, -100.0f};
      _mm256_store_ps(lane, exp_nonpositive(_mm256_load_ps(lane)));
      sum += lane[0];
    }
    const float inverse = 1.0f / sum;
    for (int64_t t = 0; t < ctx; ++t) si[t] *= inverse;
  }
  float* heads_out = out + kv_head * shared * D;
  const KV* values = cache + s.layer_offset + value_offset + head_offset;
  switch (shared) {  // the query heads of this KV head together: each value row is read once
    case 1: return weighted_values<1, 8>(s, values, table, first, ctx, scores, heads_out);
    case 2: return weighted_values<2, 4>(s, values, table, first, ctx, scores, heads_out);
    case 3: return weighted_values<3, 4>(s, values, table, first, ctx, scores, heads_out);
    case 4: return weighted_values<4, 2>(s, values, table, first, ctx, scores, heads_out);
    default: break;
  }
  for (int64_t i = 0; i < shared; ++i) {
    const float* wi = scores + i * ctx;
    float* o = out + (kv_head * shared + i) * D;
    for (int64_t c0 = 0; c0 < chunks; c0 += 8) {
      const int64_t n = std::min<int64_t>(8, chunks - c0);
      __m256 acc[8];
      for (int64_t c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
      // Block by block (no division per position), positions in order as before.
      for (int64_t j = 0; j < ctx;) {
        const int64_t p = first + j, offset = p % s.bs, run = std::min(s.bs - offset, ctx - j);
        const KV* block = cache + table[p / s.bs] * s.block_stride + s.layer_offset + value_offset +
                          head_offset + offset * D + 8 * c0;
        for (int64_t t = 0; t < run; ++t, ++j) {
          const KV* v = block + t * D;
          const __m256 w = _mm256_set1_ps(wi[j]);
          if (n == 8) {
            for (int64_t c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(w, load8(v + 8 * c), acc[c]);
          } else {
            for (int64_t c = 0; c < n; ++c) acc[c] = _mm256_fmadd_ps(w, load8(v + 8 * c), acc[c]);
          }
        }
      }
      for (int64_t c = 0; c < n; ++c) _mm256_storeu_ps(o + 8 * (c0 + c), acc[c]);
    }
  }
}

#pragma GCC pop_options

bool supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// (key, KV head) pairs below which a call runs on one thread: one query's (one stream's decode
// step), or several queries'. The keys and values a batch reads come mostly from memory (a layer of
// 16 streams of 80 tokens: 2 MB of a float32 cache), so a second thread pays from a few hundred
// pairs on: at 4096 for both (the release before) 16 streams of 64-token contexts ran on one
// thread, and the SmolLM2 Q4_K_M file decoded 16 streams at 958-1046 tok/s against 1062-1134 with
// 512 (alternating runs, Zen 4). One query keeps 4096: served over HTTP, where the server's and the
// client's wake-ups take a core now and then, it was measured faster on the calling thread alone.
constexpr int64_t kInlineKeysOne = 4096, kInlineKeysMany = 512;

}  // namespace

namespace ponder {

void decode_attention(const at::Tensor& queries, const at::Tensor& rows, const at::Tensor& cache,
                      const at::Tensor& tables, const at::Tensor& ctx, int64_t layer, double scale, at::Tensor out,
                      double softcap, int64_t window, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(softcap >= 0 && window >= 0, "decode_attention: softcap and window must be >= 0 (0: none)");
  TORCH_CHECK(supported(), "decode_attention: this CPU lacks AVX2 or FMA");
  TORCH_CHECK(cache.dim() == 6 && (cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kBFloat16) &&
              cache.is_contiguous(),
              "decode_attention: cache must be contiguous float32 or bfloat16 [blocks, layers, 2, kv_heads, block_size, "
              "head_dim]");
  const int64_t L = cache.size(1), KVH = cache.size(3), bs = cache.size(4), D = cache.size(5);
  TORCH_CHECK(D % 8 == 0, "decode_attention: head_dim must be a multiple of 8");
  TORCH_CHECK(layer >= 0 && layer < L, "decode_attention: no layer ", layer);
  TORCH_CHECK(queries.dim() == 3 && queries.scalar_type() == at::kFloat && queries.size(2) == D &&
              queries.stride(2) == 1 && queries.stride(1) == D && queries.size(1) % KVH == 0,
              "decode_attention: queries must be float32 [tokens, heads, head_dim], each row's heads contiguous");
  TORCH_CHECK(out.dim() == 3 && out.is_contiguous() && out.scalar_type() == at::kFloat &&
              out.size(0) == queries.size(0) && out.size(1) == queries.size(1) && out.size(2) == D,
              "decode_attention: out must be contiguous float32 shaped like queries");
  const int64_t G = rows.size(0);
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                                     sinks->dim() == 1 && sinks->size(0) == queries.size(1)),
              "decode_attention: sinks must be contiguous float32 [heads]");
  const float* sp = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 1,
              "decode_attention: rows must be contiguous int64 [queries]");
  TORCH_CHECK(ctx.scalar_type() == at::kLong && ctx.is_contiguous() && ctx.dim() == 1 && ctx.size(0) == G,
              "decode_attention: ctx must be contiguous int64 [queries]");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2 && tables.size(0) == G,
              "decode_attention: tables must be contiguous int64 [queries, blocks]");
  const Layout s{queries.size(1), KVH, D, bs, tables.size(1), static_cast<float>(softcap), window,
                 queries.stride(0), cache.stride(0), layer * cache.stride(1)};
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* cp = ctx.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t blocks = cache.size(0), T = queries.size(0);
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(rp[g] >= 0 && rp[g] < T, "decode_attention: row ", rp[g], " is not a query");
    TORCH_CHECK(cp[g] >= 1 && cp[g] <= s.W * bs, "decode_attention: a context of ", cp[g], " does not fit its table");
    for (int64_t b = 0; b < (cp[g] + bs - 1) / bs; ++b)
      TORCH_CHECK(tp[g * s.W + b] >= 0 && tp[g * s.W + b] < blocks, "decode_attention: no block ", tp[g * s.W + b]);
  }
  int64_t longest = 0;
  for (int64_t g = 0; g < G; ++g) longest = std::max(longest, cp[g]);
  const float* qp = queries.data_ptr<float>();
  const bool wide = cache.scalar_type() == at::kFloat;
  const float* kv = wide ? cache.data_ptr<float>() : nullptr;
  const uint16_t* kv16 = wide ? nullptr : reinterpret_cast<const uint16_t*>(cache.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t shared = s.H / KVH;
  // Each thread takes a contiguous range of items. A prompt's queries come in order of their
  // context, so items are taken from both ends in turn (shortest, longest, second shortest, ...):
  // every range holds about the same number of keys. The order never changes a query's arithmetic.
  // A call with few keys in all (one stream's decode step) runs on the calling thread alone: waking
  // the others and waiting for them costs more than they save, most of all on a busy machine.
  int64_t keys = 0;
  for (int64_t g = 0; g < G; ++g) keys += cp[g];
  const int64_t grain = keys * KVH < (G == 1 ? kInlineKeysOne : kInlineKeysMany) ? G * KVH : 1;
  at::parallel_for(0, G * KVH, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(shared * longest);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t k = i / KVH, h = i % KVH, g = k % 2 ? G - 1 - k / 2 : k / 2;
      if (wide)
        attend_head(s, qp + rp[g] * s.q_stride, kv, tp + g * s.W, cp[g], h, sc, op + rp[g] * s.H * D, scores.data(),
                    sp);
      else
        attend_head(s, qp + rp[g] * s.q_stride, kv16, tp + g * s.W, cp[g], h, sc, op + rp[g] * s.H * D,
                    scores.data(), sp);
    }
  });
}

}  // namespace ponder

TORCH_LIBRARY_FRAGMENT(ponder, m) {
  m.def("decode_attention(Tensor queries, Tensor rows, Tensor cache, Tensor tables, Tensor ctx, int layer, "
        "float scale, Tensor(a!) out, float softcap=0, int window=0, Tensor? sinks=None) -> ()");
}
TORCH_LIBRARY_IMPL(ponder, CPU, m) { m.impl("decode_attention", &ponder::decode_attention); }
