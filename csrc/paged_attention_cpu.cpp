// Paged attention on CPU: every query token attends over its sequence's KV blocks, read
// straight through the block table (no gather copy), with an online softmax per block.
//
//   q            [T, H, D]          float32, contiguous
//   k/v_cache    [NB, BS, KVH, D]   float32, contiguous (one layer)
//   block_tables [S, MB]            int32
//   seq_ids      [T]                int32   which sequence each token belongs to
//   kv_lens      [T]                int32   keys the token may see (its position + 1)
//   out          [T, H, D]
//
// Work is split over (token, kv head); the G = H / KVH query heads that share a KV head are
// processed together so each K/V row is loaded once for all of them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                     torch::Tensor v_cache, torch::Tensor block_tables, torch::Tensor seq_ids,
                     torch::Tensor kv_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32, "pkv cpu attention: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  out.is_contiguous() && block_tables.is_contiguous(),
              "pkv cpu attention: contiguous tensors expected");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  const int64_t MB = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sid = seq_ids.data_ptr<int32_t>();
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const int64_t row = KVH * D;  // stride between two tokens of a block

  at::parallel_for(0, T * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * BS), acc(G * D), m(G), l(G);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = w / KVH, kh = w % KVH;
      const int64_t len = lens[t];
      const int32_t* table = bt + static_cast<int64_t>(sid[t]) * MB;
      const float* qg = qp + (t * H + kh * G) * D;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t b = 0; b * BS < len; ++b) {
        const int64_t n = std::min(BS, len - b * BS);
        const int64_t base = (static_cast<int64_t>(table[b]) * BS * KVH + kh) * D;
        const float* kb = kp + base;
        const float* vb = vp + base;
        for (int64_t g = 0; g < G; ++g) {
          float* s = scores.data() + g * BS;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < n; ++j) {
            s[j] = dot(qg + g * D, kb + j * row, D) * fscale;
            block_max = std::max(block_max, s[j]);
          }
          const float m_new = std::max(m[g], block_max);
          const float correction = std::exp(m[g] - m_new);
          float* a = acc.data() + g * D;
          l[g] *= correction;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] *= correction;
          for (int64_t j = 0; j < n; ++j) {
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over block tables (CPU)");
}
