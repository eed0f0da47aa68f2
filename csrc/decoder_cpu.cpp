// The decoder stack of a float32 model on CPU in one call per step, its linears either 4-bit
// AWQ (csrc/awq_cpu.cpp) or float32 weights packed by oneDNN (mkldnn::_linear_pointwise).
//
// At batch 1 a 4-bit layer's kernels take ~150 us, and the Python between them (module calls,
// splits, views, argument parsing: ~40 calls a layer) took another ~100 us. This runs the same
// kernels in the same order as the Python model files do with them (so its outputs are those
// of the Python path), with the Python left out. A layer is Llama's with the options the
// dense families add (each absent for Llama):
//
//   h, residual = embeddings, -
//   per layer: x = residual + h                      (the residual stream)
//              a = in_norm(x)                        (OLMo 2: no pre-norm, a = x)
//              q, k, v = a Wqkv; q_norm(q), k_norm(k) (per head, or over the projection)
//              RoPE(q, k) (its own tables per layer; none on NoPE layers)
//              write k, v; attend (window, soft-cap); h = attn Wo
//              h = attn_out_norm(h) * multiplier      (Gemma, OLMo 2; Granite)
//              x = residual + h; a = mlp_in_norm(x)   (OLMo 2: a = x)
//              h = down(act(gate) * up); h = mlp_out_norm(h) * multiplier
//   return final_norm(h + residual)
// Built inside csrc/kernels_cpu.cpp, after the kernels it calls.
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

using OptTensor = std::optional<torch::Tensor>;

struct Layer {
  OptTensor in_norm, attn_out_norm, mlp_in_norm, mlp_out_norm, q_norm, k_norm;
  bool qk_norm_full;  // q/k norms over the whole projection (OLMo 2), else per head
  OptTensor cos, sin;  // none: no RoPE on this layer
  int64_t window;  // 0: global attention
  double soft_cap, multiplier;  // 0: no soft-cap; sub-layer outputs are scaled by multiplier
  bool gelu;  // GeGLU (tanh) instead of SwiGLU
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
             int64_t max_gemv_rows, torch::Tensor norm)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps),
        max_gemv_rows_(max_gemv_rows), norm_(norm) {}

  // One layer: its norms (in, attn_out, mlp_in, mlp_out, q, k; None where absent) and
  // options, then per linear (qkv, o, gate_up, down) its weights (AWQ: codes, scales, zs;
  // float32: the packed weight), bias, output size and AWQ group size (0: float32).
  void add_layer(std::vector<OptTensor> norms, bool qk_norm_full, OptTensor cos,
                 OptTensor sin, int64_t window, double soft_cap, double multiplier, bool gelu,
                 std::vector<std::vector<torch::Tensor>> weights, std::vector<OptTensor> biases,
                 std::vector<int64_t> sizes, std::vector<int64_t> groups) {
    TORCH_CHECK(norms.size() == 6, "add_layer: six norms (in, attn_out, mlp_in, mlp_out, q, k)");
    TORCH_CHECK(weights.size() == 4 && biases.size() == 4 && sizes.size() == 4 &&
                    groups.size() == 4,
                "add_layer: four linears (qkv, o, gate_up, down)");
    Linear linears[4];
    for (size_t i = 0; i < 4; ++i) {
      TORCH_CHECK(weights[i].size() == (groups[i] > 0 ? 3u : 1u),
                  "add_layer: AWQ takes (codes, scales, zs), float32 the packed weight");
      linears[i] = {weights[i], biases[i], sizes[i], groups[i]};
    }
    layers_.push_back({norms[0], norms[1], norms[2], norms[3], norms[4], norms[5], qk_norm_full,
                       cos, sin, window, soft_cap, multiplier, gelu, linears[0], linears[1],
                       linears[2], linears[3]});
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
      h = enter(h, residual, layer.in_norm);
      const torch::Tensor qkv = linear(h, layer.qkv);
      const torch::Tensor q = qkv.narrow(1, 0, q_size).view({T, heads_, head_dim_});
      const torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, kv_heads_, head_dim_});
      const torch::Tensor v =
          qkv.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads_, head_dim_});
      if (layer.q_norm) {
        const auto qn = layer.qk_norm_full ? q.view({T, 1, q_size}) : q;
        const auto kn = layer.qk_norm_full ? k.view({T, 1, kv_size}) : k;
        head_rms_norm(qn, qn, *layer.q_norm, eps_);
        head_rms_norm(kn, kn, *layer.k_norm, eps_);
      }
      if (layer.cos) rotary(positions, q, k, *layer.cos, *layer.sin);
      auto attn = torch::empty({T, heads_, head_dim_}, h.options());
      paged_attention(attn, q, k, v, kv_caches[i].first, kv_caches[i].second, slot_mapping,
                      block_tables, seq_ids, kv_lens, scale_, layer.window, layer.soft_cap);
      h = leave(linear(attn.view({T, q_size}), layer.o), layer.attn_out_norm, layer.multiplier);
      h = enter(h, residual, layer.mlp_in_norm);
      const torch::Tensor gate_up = linear(h, layer.gate_up);
      auto act = torch::empty({T, gate_up.size(1) / 2}, h.options());
      if (layer.gelu) {
        gelu_tanh_and_mul(act, gate_up);
      } else {
        silu_and_mul(act, gate_up);
      }
      h = leave(linear(act, layer.down), layer.mlp_out_norm, layer.multiplier);
    }
    add_rms_norm(h, residual, norm_, eps_);
    return h;
  }

 private:
  // Into a sub-layer: residual += h (the first layer's residual is h), then its input is
  // norm(residual), written over h, or the residual itself without a norm.
  torch::Tensor enter(torch::Tensor h, torch::Tensor& residual, const OptTensor& norm) const {
    if (!residual.defined()) {
      residual = h;
      if (!norm) return residual;
      auto out = torch::empty_like(residual);
      rms_norm(out, residual, *norm, eps_);
      return out;
    }
    if (norm) {
      add_rms_norm(h, residual, *norm, eps_);
      return h;
    }
    residual.add_(h);
    return residual;
  }

  // Out of a sub-layer: its output normalized (post-norm families) and scaled.
  torch::Tensor leave(torch::Tensor h, const OptTensor& norm, double multiplier) const {
    if (norm) {
      auto out = torch::empty_like(h);
      rms_norm(out, h, *norm, eps_);
      h = out;
    }
    if (multiplier != 1.0) h.mul_(multiplier);
    return h;
  }

  torch::Tensor linear(const torch::Tensor& x, const Linear& w) const {
    if (w.group == 0) return packed_linear(x, w.weights[0], w.bias);
    return awq_linear(x, w.weights[0], w.weights[1], w.weights[2], w.bias, w.n, w.group,
                      max_gemv_rows_);
  }

  int64_t heads_, kv_heads_, head_dim_;
  double scale_, eps_;
  int64_t max_gemv_rows_;
  torch::Tensor norm_;
  std::vector<Layer> layers_;
};
