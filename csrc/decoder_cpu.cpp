// The decoder stack of a 4-bit AWQ Llama on CPU in one call per step.
//
// At batch 1 a 4-bit layer's kernels take ~150 us, and the Python between them (module calls,
// splits, views, argument parsing: ~40 calls a layer) took another ~100 us. This runs the same
// kernels in the same order as core/models/llama.py does with them (so its outputs are
// bitwise those of the Python path), with the Python left out:
//
//   h, residual = embeddings, -
//   per layer: h = norm1(h + residual); qkv = h Wqkv; RoPE(q, k); write k, v; attend;
//              h = attn Wo; h = norm2(h + residual); h = down(silu(gate) * up)
//   return final_norm(h + residual)
#define PKV_NO_MODULE
#include "awq_cpu.cpp"
#include "layer_ops_cpu.cpp"
#include "paged_attention_cpu.cpp"
#undef PKV_NO_MODULE

#include <optional>
#include <utility>
#include <vector>

namespace {

struct AwqLinear {
  torch::Tensor codes, scales, zs;
  std::optional<torch::Tensor> bias;
  int64_t n;
};

struct Layer {
  torch::Tensor input_norm, post_attention_norm;
  AwqLinear qkv, o, gate_up, down;
};

}  // namespace

class AwqDecoder {
 public:
  AwqDecoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, int64_t group,
             int64_t max_gemv_rows, torch::Tensor cos, torch::Tensor sin, torch::Tensor norm)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), group_(group),
        max_gemv_rows_(max_gemv_rows), cos_(cos), sin_(sin), norm_(norm) {}

  // One layer: its two norm weights and, per linear (qkv, o, gate_up, down), the kernel
  // layout (codes, scales, zs), an optional bias and the output size.
  void add_layer(torch::Tensor input_norm, torch::Tensor post_attention_norm,
                 std::vector<torch::Tensor> tensors,
                 std::vector<std::optional<torch::Tensor>> biases, std::vector<int64_t> sizes) {
    TORCH_CHECK(tensors.size() == 12 && biases.size() == 4 && sizes.size() == 4,
                "add_layer: four linears of (codes, scales, zs), biases and sizes");
    AwqLinear linears[4];
    for (size_t i = 0; i < 4; ++i)
      linears[i] = {tensors[3 * i], tensors[3 * i + 1], tensors[3 * i + 2], biases[i], sizes[i]};
    layers_.push_back({input_norm, post_attention_norm, linears[0], linears[1], linears[2],
                       linears[3]});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  torch::Tensor forward(torch::Tensor h, torch::Tensor positions,
                        const std::vector<std::pair<torch::Tensor, torch::Tensor>>& kv_caches,
                        torch::Tensor slot_mapping, torch::Tensor block_tables,
                        torch::Tensor seq_ids, torch::Tensor kv_lens, double scale) {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one (k, v) cache per layer expected");
    const int64_t T = h.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    torch::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      if (i == 0) {
        residual = h;
        h = torch::empty_like(residual);
        rms_norm(h, residual, layer.input_norm, eps_);
      } else {
        add_rms_norm(h, residual, layer.input_norm, eps_);
      }
      const torch::Tensor qkv = linear(h, layer.qkv);
      const torch::Tensor q = qkv.narrow(1, 0, q_size).view({T, heads_, head_dim_});
      const torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, kv_heads_, head_dim_});
      const torch::Tensor v =
          qkv.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads_, head_dim_});
      rotary(positions, q, k, cos_, sin_);
      auto attn = torch::empty({T, heads_, head_dim_}, h.options());
      paged_attention(attn, q, k, v, kv_caches[i].first, kv_caches[i].second, slot_mapping,
                      block_tables, seq_ids, kv_lens, scale);
      h = linear(attn.view({T, q_size}), layer.o);
      add_rms_norm(h, residual, layer.post_attention_norm, eps_);
      const torch::Tensor gate_up = linear(h, layer.gate_up);
      auto act = torch::empty({T, gate_up.size(1) / 2}, h.options());
      silu_and_mul(act, gate_up);
      h = linear(act, layer.down);
    }
    add_rms_norm(h, residual, norm_, eps_);
    return h;
  }

 private:
  torch::Tensor linear(const torch::Tensor& x, const AwqLinear& w) const {
    return awq_linear(x, w.codes, w.scales, w.zs, w.bias, w.n, group_, max_gemv_rows_);
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  int64_t group_, max_gemv_rows_;
  torch::Tensor cos_, sin_, norm_;
  std::vector<Layer> layers_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<AwqDecoder>(m, "AwqDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, int64_t, int64_t, torch::Tensor,
                          torch::Tensor, torch::Tensor>())
      .def("add_layer", &AwqDecoder::add_layer)
      .def("num_layers", &AwqDecoder::num_layers)
      .def("forward", &AwqDecoder::forward);
}
