// Paged attention on CPU: every token's K/V is written into its cache slot, then every query
// token attends over its sequence's KV blocks, read straight through the block table (no
// gather copy), with an online softmax per block.
//
//   q            [T, H, D]          float32, rows may be strided (views of a fused qkv)
//   k/v          [T, KVH, D]        float32, the step's new keys and values, likewise
//   k/v_cache    [NB, BS, KVH, D]   float32, contiguous (one layer)
//   slot_mapping [T]                int64   cache slot of each token's K/V
//   block_tables [S, MB]            int32
//   seq_ids      [T]                int32   which sequence each token belongs to
//   kv_lens      [T]                int32   keys the token may see (its position + 1)
//   out          [T, H, D]          contiguous
//   window       > 0: a token sees only its last `window` keys (itself included)
//   soft_cap     > 0: scores become soft_cap * tanh(scores / soft_cap) (Gemma 2)
//
// With a window, blocks wholly before it are never read (they may already be back in the
// pool, their table entries stale).
//
// Work is split over (token, kv head); the G = H / KVH query heads that share a KV head are
// processed together so each K/V row is loaded once for all of them. Head sizes of 16..128
// (multiples of 16) take a vectorized path: q and the accumulators live in 16-float vectors,
// the block's scores are exponentiated 16 at a time (a polynomial exp, ~1 ulp), and each V
// row is loaded once for all G heads. Other sizes take the scalar loop.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_math.h"

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// scores[0, n) -> cap * tanh(scores / cap), 16 at a time (n may be rounded up: the buffer is
// padded), tanh(y) = 1 - 2 / (exp(2y) + 1): a scalar tanh per score cost Gemma 2 ~15% of a
// batch-64 step.
static inline void soft_cap16(float* scores, int64_t n, float cap) {
  const float inv = 2.f / cap;
  for (int64_t c = 0; c < n; c += 16) {
    const vf16 x = load16(scores + c);
    store16(scores + c, cap * (1.f - 2.f / (vexp(x * inv) + 1.f)));
  }
}

// State of one token's attention over KV heads [kh0, kh1): G query heads each.
struct VecState {
  std::vector<vf16> q, acc;  // [heads][DC]
  std::vector<float> m, l, scores;  // scores: [heads][BS rounded up to 16]
};

// One token over its KV heads [kh0, kh1), G query heads each, D = 16 * DC. Keys are walked
// row by row across the KV heads, so a block's K (then V) is read front to back.
template <int64_t DC>
static void attend_vec(const float* qt, const float* kp, const float* vp, const int32_t* table,
                       int64_t len, int64_t lo, int64_t BS, int64_t KVH, int64_t kh0,
                       int64_t kh1, int64_t G, float scale, float cap, VecState& st, float* ot) {
  constexpr int64_t D = 16 * DC;
  const int64_t padded = (BS + 15) / 16 * 16, row = KVH * D;
  const int64_t h0 = kh0 * G, heads = (kh1 - kh0) * G;
  st.q.resize(heads * DC);
  st.acc.assign(heads * DC, vf16{});
  st.m.assign(heads, -std::numeric_limits<float>::infinity());
  st.l.assign(heads, 0.f);
  st.scores.resize(heads * padded);
  vf16* q = st.q.data();
  vf16* acc = st.acc.data();
  float* scores = st.scores.data();
  std::memcpy(q, qt + h0 * D, heads * D * sizeof(float));
  for (int64_t i = 0; i < heads * DC; ++i) q[i] *= scale;
  for (int64_t b = lo / BS; b * BS < len; ++b) {
    const int64_t n = std::min(BS, len - b * BS);
    const int64_t j0 = std::max<int64_t>(0, lo - b * BS);  // first key inside the window
    const int64_t base = static_cast<int64_t>(table[b]) * BS * row;
    for (int64_t j = j0; j < n; ++j) {
      for (int64_t kh = kh0; kh < kh1; ++kh) {
        vf16 k[DC];
        for (int64_t c = 0; c < DC; ++c) k[c] = load16(kp + base + j * row + kh * D + 16 * c);
        for (int64_t h = (kh - kh0) * G; h < (kh - kh0 + 1) * G; ++h) {
          const vf16* qh = q + h * DC;
          vf16 d = qh[0] * k[0];
          for (int64_t c = 1; c < DC; ++c) d += qh[c] * k[c];
          scores[h * padded + j] = hsum(d);
        }
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* sc = scores + h * padded;
      if (cap > 0.f) soft_cap16(sc, n, cap);
      float block_max = sc[j0];
      for (int64_t j = j0 + 1; j < n; ++j) block_max = std::max(block_max, sc[j]);
      const float m_new = std::max(st.m[h], block_max);
      const float correction = std::exp(st.m[h] - m_new);
      for (int64_t c = 0; c < n; c += 16) {
        store16(sc + c, vexp(load16(sc + c) - m_new));
      }
      for (int64_t j = 0; j < j0; ++j) sc[j] = 0.f;  // keys before the window
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) sum += sc[j];
      st.l[h] = st.l[h] * correction + sum;
      for (int64_t c = 0; c < DC; ++c) acc[h * DC + c] *= correction;
      st.m[h] = m_new;
    }
    for (int64_t j = j0; j < n; ++j) {
      for (int64_t kh = kh0; kh < kh1; ++kh) {
        vf16 v[DC];
        for (int64_t c = 0; c < DC; ++c) v[c] = load16(vp + base + j * row + kh * D + 16 * c);
        for (int64_t h = (kh - kh0) * G; h < (kh - kh0 + 1) * G; ++h) {
          const float p = scores[h * padded + j];
          for (int64_t c = 0; c < DC; ++c) acc[h * DC + c] += p * v[c];
        }
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.f / st.l[h];
    for (int64_t c = 0; c < DC; ++c) acc[h * DC + c] *= inv;
  }
  std::memcpy(ot + h0 * D, acc, heads * D * sizeof(float));
}

// Rows of a [T, heads, D] tensor whose last two dimensions are dense.
static void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == torch::kFloat32 && t.stride(2) == 1 &&
                  t.stride(1) == t.size(2),
              "pkv cpu attention: ", name, " must be float32 [T, heads, D] with dense rows");
}

// Every token's K/V rows into its slot; slots are distinct, so tokens never collide.
static void write_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
                     torch::Tensor& v_cache, const torch::Tensor& slot_mapping) {
  const int64_t T = k.size(0), row = k.size(1) * k.size(2);
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "pkv cpu attention: slot out of range");
    std::memcpy(kc + slot[t] * row, kp + t * k.stride(0), row * sizeof(float));
    std::memcpy(vc + slot[t] * row, vp + t * v.stride(0), row * sizeof(float));
  }
}

void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                     torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping,
                     torch::Tensor block_tables, torch::Tensor seq_ids, torch::Tensor kv_lens,
                     double scale, int64_t window, double soft_cap) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(v, "v");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous() &&
                  block_tables.is_contiguous() && seq_ids.is_contiguous() &&
                  kv_lens.is_contiguous() && slot_mapping.is_contiguous(),
              "pkv cpu attention: contiguous caches, output and metadata expected");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32 &&
                  k.sizes() == v.sizes() && k.size(1) == k_cache.size(2) &&
                  k.size(2) == k_cache.size(3) && slot_mapping.size(0) == k.size(0) &&
                  slot_mapping.scalar_type() == torch::kInt64,
              "pkv cpu attention: k/v, caches and slot_mapping disagree");
  write_kv(k, v, k_cache, v_cache, slot_mapping);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), QS = q.stride(0);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  const int64_t MB = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sid = seq_ids.data_ptr<int32_t>();
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
  const auto first_key = [&](int64_t len) {
    return window > 0 ? std::max<int64_t>(0, len - window) : int64_t{0};
  };
  const int64_t row = KVH * D;  // stride between two tokens of a block

  const int64_t DC = D % 16 == 0 ? D / 16 : 0;
  if (DC == 1 || DC == 2 || DC == 4 || DC == 8) {
    // Many tokens: one work item per token, all its KV heads (blocks read front to back).
    // Few tokens (batch-1 decode): one per (token, KV head), so every core has work.
    const int64_t split = T >= 2 * at::get_num_threads() ? 1 : KVH;
    const auto run = DC == 1 ? attend_vec<1> : DC == 2 ? attend_vec<2>
                     : DC == 4 ? attend_vec<4> : attend_vec<8>;
    at::parallel_for(0, T * split, 1, [&](int64_t begin, int64_t end) {
      VecState st;
      for (int64_t w = begin; w < end; ++w) {
        const int64_t t = w / split, part = w % split;
        const int64_t kh0 = split == 1 ? 0 : part, kh1 = split == 1 ? KVH : part + 1;
        run(qp + t * QS, kp, vp, bt + static_cast<int64_t>(sid[t]) * MB, lens[t],
            first_key(lens[t]), BS, KVH, kh0, kh1, G, fscale, cap, st, op + t * H * D);
      }
    });
    return;
  }
  at::parallel_for(0, T * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * BS), acc(G * D), m(G), l(G);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = w / KVH, kh = w % KVH;
      const int64_t len = lens[t], lo = first_key(len);
      const int32_t* table = bt + static_cast<int64_t>(sid[t]) * MB;
      const float* qg = qp + t * QS + kh * G * D;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t b = lo / BS; b * BS < len; ++b) {
        const int64_t n = std::min(BS, len - b * BS);
        const int64_t j0 = std::max<int64_t>(0, lo - b * BS);
        const int64_t base = (static_cast<int64_t>(table[b]) * BS * KVH + kh) * D;
        const float* kb = kp + base;
        const float* vb = vp + base;
        for (int64_t g = 0; g < G; ++g) {
          float* s = scores.data() + g * BS;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t j = j0; j < n; ++j) {
            s[j] = dot(qg + g * D, kb + j * row, D) * fscale;
            if (cap > 0.f) s[j] = cap * std::tanh(s[j] / cap);
            block_max = std::max(block_max, s[j]);
          }
          const float m_new = std::max(m[g], block_max);
          const float correction = std::exp(m[g] - m_new);
          float* a = acc.data() + g * D;
          l[g] *= correction;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] *= correction;
          for (int64_t j = j0; j < n; ++j) {
            const float p = std::exp(s[j] - m_new);
            l[g] += p;
            const float* vj = vb + j * row;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * vj[d];
          }
          m[g] = m_new;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (t * H + kh * G + g) * D;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  });
}
