// The decoder stack of a float32 Llama on CPU in one call per step, its linears either 4-bit
// AWQ (csrc/awq_cpu.cpp) or float32 weights packed by oneDNN (mkldnn::_linear_pointwise).
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

// AWQ: codes, scales, zs and the group size; float32: the oneDNN-packed weight alone.
struct Linear {
  std::vector<torch::Tensor> weights;
  std::optional<torch::Tensor> bias;
  int64_t n, group;
};

struct Layer {
  torch::Tensor input_norm, post_attention_norm;
  Linear qkv, o, gate_up, down;
};

// What `torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")` runs.
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const std::optional<torch::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&,
                                                  const std::optional<torch::Tensor>&,
                                                  c10::string_view,
                                                  c10::List<std::optional<c10::Scalar>>,
                                                  std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<c10::Scalar>>(), "");
}

}  // namespace

class CpuDecoder {
 public:
  CpuDecoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, double eps,
             int64_t max_gemv_rows, torch::Tensor cos, torch::Tensor sin, torch::Tensor norm)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps),
        max_gemv_rows_(max_gemv_rows), cos_(cos), sin_(sin), norm_(norm) {}

  // One layer: its two norm weights and, per linear (qkv, o, gate_up, down), its weights
  // (AWQ: codes, scales, zs; float32: the packed weight), bias, output size and AWQ group
  // size (0: float32).
  void add_layer(torch::Tensor input_norm, torch::Tensor post_attention_norm,
                 std::vector<std::vector<torch::Tensor>> weights,
                 std::vector<std::optional<torch::Tensor>> biases, std::vector<int64_t> sizes,
                 std::vector<int64_t> groups) {
    TORCH_CHECK(weights.size() == 4 && biases.size() == 4 && sizes.size() == 4 &&
                    groups.size() == 4,
                "add_layer: four linears (qkv, o, gate_up, down)");
    Linear linears[4];
    for (size_t i = 0; i < 4; ++i) {
      TORCH_CHECK(weights[i].size() == (groups[i] > 0 ? 3u : 1u),
                  "add_layer: AWQ takes (codes, scales, zs), float32 the packed weight");
      linears[i] = {weights[i], biases[i], sizes[i], groups[i]};
    }
    layers_.push_back({input_norm, post_attention_norm, linears[0], linears[1], linears[2],
                       linears[3]});
  }

  torch::Tensor forward(torch::Tensor h, torch::Tensor positions,
                        const std::vector<std::pair<torch::Tensor, torch::Tensor>>& kv_caches,
                        torch::Tensor slot_mapping, torch::Tensor block_tables,
                        torch::Tensor seq_ids, torch::Tensor kv_lens) {
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
                      block_tables, seq_ids, kv_lens, scale_, 0, 0.0);
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
  torch::Tensor linear(const torch::Tensor& x, const Linear& w) const {
    if (w.group == 0) return packed_linear(x, w.weights[0], w.bias);
    return awq_linear(x, w.weights[0], w.weights[1], w.weights[2], w.bias, w.n, w.group,
                      max_gemv_rows_);
  }

  int64_t heads_, kv_heads_, head_dim_;
  double scale_, eps_;
  int64_t max_gemv_rows_;
  torch::Tensor cos_, sin_, norm_;
  std::vector<Layer> layers_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<CpuDecoder>(m, "CpuDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, int64_t, torch::Tensor,
                          torch::Tensor, torch::Tensor>())
      .def("add_layer", &CpuDecoder::add_layer)
      .def("forward", &CpuDecoder::forward);
}
