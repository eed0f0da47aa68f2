// Bidirectional attention for encoders (BERT): each prompt's rows attend to all of its own rows,
// with no KV cache and no mask. A step's prompts lie end to end:
//
//   q         [T, H, D]    float32, dense rows (may be strided between tokens)
//   k / v     [T, KVH, D]  float32, contiguous (H a multiple of KVH)
//   starts    [S + 1]      int64: prompt s is rows [starts[s], starts[s + 1])
//   returns   [T, H, D]
//
// The work is the tiled prefill path's (csrc/paged_prefill_cpu.cpp: `prefill::attend_item`),
// its keys read in place from k and v: items of (prompt, KV head, tile of query rows), handed
// out dearest first, every key tile unmasked (a row sees each key of its prompt). One call runs
// a step's prompts together, where one torch SDPA call per prompt paid its dispatch and its
// threads' start on each prompt's short rows.
#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>
#include <vector>

at::Tensor bidirectional_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& starts, double scale) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(v, "v");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() &&
                  k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(1) > 0 &&
                  q.size(1) % k.size(1) == 0,
              "pkv cpu attention: k and v must be contiguous [T, KVH, D] beside q [T, H, D]");
  TORCH_CHECK(q.size(2) % 16 == 0, "pkv cpu attention: bidirectional attention needs a head "
              "size that is a multiple of 16, not ", q.size(2));
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.dim() == 1 && starts.size(0) >= 1 &&
                  starts.is_contiguous(),
              "pkv cpu attention: starts must be int64 [prompts + 1]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1), G = H / KVH;
  const int64_t S = starts.size(0) - 1;
  const int64_t* st = starts.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(st[s] <= st[s + 1], "pkv cpu attention: starts must not decrease");
  TORCH_CHECK(st[0] == 0 && st[S] == T, "pkv cpu attention: starts must run from 0 to ", T);
  at::Tensor out = at::empty({T, H, D}, q.options());
  std::vector<int32_t> lens(T);        // a row's keys are its prompt's: [0, n)
  std::vector<prefill::Item> items;
  std::vector<int64_t> first;          // each item's prompt's first row
  const int64_t tq = prefill::tile_tokens(G);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = st[s + 1] - st[s];
    std::fill(lens.begin() + st[s], lens.begin() + st[s + 1], static_cast<int32_t>(n));
    for (int64_t i = st[s]; i < st[s + 1]; i += tq)
      for (int64_t kh = 0; kh < KVH; ++kh) {
        const int64_t rows = std::min(tq, st[s + 1] - i);
        items.push_back({i, rows, kh, n * rows});
        first.push_back(st[s]);
      }
  }
  std::vector<int64_t> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return items[a].cost > items[b].cost; });
  const kv_rows::Rows K = kv_rows::Rows::of(k, D), V = kv_rows::Rows::of(v, D);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_dynamic<prefill::Buffers>(order.size(), [&](int64_t w, prefill::Buffers& buf) {
    const int64_t s0 = first[order[w]];
    const auto slot_of = [s0](int64_t pos) { return s0 + pos; };
    prefill::attend_item(items[order[w]], qp, q.stride(0), K, V, slot_of, lens.data(), 0, H, D,
                         KVH, G, static_cast<float>(scale), 0.f, op, buf);
  });
  return out;
}
