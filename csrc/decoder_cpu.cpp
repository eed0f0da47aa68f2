// The decoder stack of a float32 model on CPU in one call per step, its linears 4-bit AWQ
// (csrc/awq_cpu.cpp), ggml blocks as in a GGUF (csrc/ggml_cpu.cpp) or float32 weights
// (csrc/gemv_cpu.cpp's f32_linear).
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
// A pipeline stage (forward_stage) starts from the previous stage's (h, residual) and, but on
// the last stage, returns (h, residual) without the final norm.
// Built inside csrc/kernels_cpu.cpp, after the kernels it calls.
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "team.h"

namespace {

// AWQ: codes, scales, zs and the group size; float32: the plain [N, K] weight alone; ggml
// blocks (GGUF, group -1): each fused part's rows, then an int64 tensor of their types.
// With LoRA, the adapter slots (core/lora/layers.py): a [slots, in, W], b [slots, W, out].
// AWQ layers keep their operands (bias included, as float32) checked from add_layer on
// (`awq`): per call, the tensors' metadata is cold (see AwqOperands).
struct Linear {
  std::vector<at::Tensor> weights;
  std::optional<at::Tensor> bias;
  int64_t n, group;
  AwqOperands awq{};
  at::Tensor lora_a, lora_b;
  std::vector<int64_t> shards;  // output sizes of the fused parts (q, k, v / gate, up)
  int64_t lora_rank = 0;  // columns of a (rows of b) per part
};

// Rows this few add their adapter's delta by loops that read only the blocks an adapter
// fills (per fused part: a's R columns, b's R x part block); more rows take two GEMMs.
constexpr int64_t kLoRALoopRows = 4;

// y[r] += (x[r] @ a[:, part]) @ b[part, part's outputs] for rows start..end, every part.
void lora_rows(at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
               const at::Tensor& b, int64_t start, int64_t end,
               const std::vector<int64_t>& shards, int64_t rank) {
  const int64_t in = x.size(1), width = a.size(1), out = b.size(1);
  const float* A = a.data_ptr<float>();
  const float* B = b.data_ptr<float>();
  std::vector<float> t(rank);
  for (int64_t r = start; r < end; ++r) {
    const float* xr = x.data_ptr<float>() + r * x.stride(0);
    float* yr = y.data_ptr<float>() + r * y.stride(0);
    int64_t first = 0;
    for (size_t s = 0; s < shards.size(); ++s) {
      const int64_t col = static_cast<int64_t>(s) * rank;
      std::fill(t.begin(), t.end(), 0.0f);
      for (int64_t i = 0; i < in; ++i) {
        const float xi = xr[i];
        const float* ai = A + i * width + col;
        for (int64_t k = 0; k < rank; ++k) t[k] += xi * ai[k];
      }
      for (int64_t k = 0; k < rank; ++k) {
        const float tk = t[k];
        const float* bk = B + (col + k) * out + first;
        float* yk = yr + first;
        for (int64_t j = 0; j < shards[s]; ++j) yk[j] += tk * bk[j];
      }
      first += shards[s];
    }
  }
}

// A run of a step's rows with one adapter slot: (slot, first row, end row).
using LoRASegment = std::tuple<int64_t, int64_t, int64_t>;

using OptTensor = std::optional<at::Tensor>;

// A sub-layer norm's weight with its data checked once (none where the family has no such norm).
struct NormWeight {
  at::Tensor tensor;  // keeps the data alive
  const float* data = nullptr;
  int64_t size = 0;
  explicit operator bool() const { return data != nullptr; }
};

NormWeight norm_weight(const OptTensor& w) {
  if (!w) return {};
  TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->dim() == 1,
              "add_layer: norm weights must be contiguous float32 [hidden]");
  return {*w, w->data_ptr<float>(), w->size(0)};
}

struct Layer {
  NormWeight in_norm, attn_out_norm, mlp_in_norm, mlp_out_norm;
  OptTensor q_norm, k_norm;
  bool qk_norm_full;  // q/k norms over the whole projection (OLMo 2), else per head
  OptTensor cos, sin;  // none: no RoPE on this layer
  int64_t window;  // 0: global attention
  double soft_cap, multiplier;  // 0: no soft-cap; sub-layer outputs are scaled by multiplier
  bool gelu;  // GeGLU (tanh) instead of SwiGLU
  Linear qkv, o, gate_up, down;
};

}  // namespace

// The buffers of one forward call, reused by every layer (each layer's values are dead once
// the next layer writes the same role's): a step allocates a few tensors instead of six or
// more a layer, ~0.5 us each at batch 1. h holds the o and down projections' outputs (their
// inputs are attn and act); the views of qkv and attn are made again only when they change.
struct Workspace {
  at::Tensor qkv, attn, h, gate_up, act;
  at::Tensor q_of, q, k, v, attn_heads;  // views of qkv and attn

  // `slot` as a contiguous [rows, cols] tensor like `like`, allocated when its shape changes.
  const at::Tensor& rows(at::Tensor& slot, int64_t rows, int64_t cols, const at::Tensor& like) {
    if (!slot.defined() || slot.size(0) != rows || slot.size(1) != cols)
      slot = at::empty({rows, cols}, like.options());
    return slot;
  }
};

class CpuDecoder {
 public:
  // `norm`: the final norm's weight (none on a pipeline stage but the last).
  CpuDecoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, double eps,
             int64_t max_gemv_rows, int64_t activation_bits, const OptTensor& norm)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps),
        max_gemv_rows_(max_gemv_rows), activation_bits_(activation_bits),
        norm_(norm_weight(norm)), cpus_(team::usable_cpus()) {}

  // One layer: its norms (in, attn_out, mlp_in, mlp_out, q, k; None where absent) and
  // options, then per linear (qkv, o, gate_up, down) its weights (AWQ: codes, scales, zs;
  // float32: the packed weight), bias, output size and AWQ group size (0: float32).
  void add_layer(std::vector<OptTensor> norms, bool qk_norm_full, OptTensor cos,
                 OptTensor sin, int64_t window, double soft_cap, double multiplier, bool gelu,
                 std::vector<std::vector<at::Tensor>> weights, std::vector<OptTensor> biases,
                 std::vector<int64_t> sizes, std::vector<int64_t> groups) {
    TORCH_CHECK(norms.size() == 6, "add_layer: six norms (in, attn_out, mlp_in, mlp_out, q, k)");
    TORCH_CHECK(weights.size() == 4 && biases.size() == 4 && sizes.size() == 4 &&
                    groups.size() == 4,
                "add_layer: four linears (qkv, o, gate_up, down)");
    Linear linears[4];
    for (size_t i = 0; i < 4; ++i) {
      TORCH_CHECK(groups[i] < 0 ? weights[i].size() >= 2u
                                : weights[i].size() == (groups[i] > 0 ? 3u : 1u),
                  "add_layer: AWQ takes (codes, scales, zs), float32 the packed weight, "
                  "ggml blocks (group -1) the parts and their types");
      OptTensor bias = biases[i];
      if (bias && groups[i] > 0) bias = bias->to(at::kFloat).contiguous();
      linears[i] = {weights[i], bias, sizes[i], groups[i]};
      if (groups[i] > 0)
        linears[i].awq = awq_operands(weights[i][0], weights[i][1], weights[i][2], bias,
                                      sizes[i], groups[i]);
    }
    layers_.push_back({norm_weight(norms[0]), norm_weight(norms[1]), norm_weight(norms[2]),
                       norm_weight(norms[3]), norms[4], norms[5], qk_norm_full,
                       cos, sin, window, soft_cap, multiplier, gelu, linears[0], linears[1],
                       linears[2], linears[3]});
  }

  // LoRA slots of layer `layer`'s four linears: (a, b) of qkv, o, gate_up, down, shared
  // with the Python LoRASlots (loading an adapter writes into them in place).
  // `shards`: each linear's fused output sizes; `rank`: the slots' columns per part.
  void set_lora(int64_t layer, std::vector<at::Tensor> stacks,
                std::vector<std::vector<int64_t>> shards, int64_t rank) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) &&
                    stacks.size() == 8 && shards.size() == 4,
                "set_lora: a layer index, (a, b) and the part sizes of its four linears");
    Linear* linears[4] = {&layers_[layer].qkv, &layers_[layer].o, &layers_[layer].gate_up,
                          &layers_[layer].down};
    for (size_t i = 0; i < 4; ++i) {
      TORCH_CHECK(stacks[2 * i].is_contiguous() && stacks[2 * i + 1].is_contiguous() &&
                      stacks[2 * i].scalar_type() == at::kFloat,
                  "set_lora: contiguous float32 slots");
      linears[i]->lora_a = stacks[2 * i];
      linears[i]->lora_b = stacks[2 * i + 1];
      linears[i]->shards = shards[i];
      linears[i]->lora_rank = rank;
    }
  }

  // This step's runs of rows by adapter slot (empty: no adapter in the step).
  void set_lora_segments(std::vector<LoRASegment> segments) { segments_ = std::move(segments); }

  // The decoder stack over h [T, hidden]. At decode sizes (every linear a GEMV) the whole
  // forward runs in one team of threads (csrc/team.h): ~150 parallel loops a step cost a
  // cache line each way instead of an OpenMP region each. Longer steps keep one region per
  // loop: there torch's GEMMs (oneDNN), which a team would run on one thread, take over; so
  // do processes with more threads than CPUs (see team::usable_cpus).
  // KV groups (core/layers/kv_groups.py): layer i writes and reads through
  // slot_mappings[g] and block_tables[g], g = layer_groups[i] (no groups: g = 0).
  at::Tensor forward(at::Tensor h, const at::Tensor& positions,
                     const std::vector<std::pair<at::Tensor, at::Tensor>>& kv_caches,
                     const std::vector<at::Tensor>& slot_mappings,
                     const std::vector<at::Tensor>& block_tables,
                     const std::vector<int64_t>& layer_groups, const at::Tensor& seq_ids,
                     const at::Tensor& kv_lens) {
    return std::get<0>(forward_stage(h, std::nullopt, positions, kv_caches, slot_mappings,
                                     block_tables, layer_groups, seq_ids, kv_lens, true));
  }

  // A pipeline stage's layers: from the previous stage's (h, residual) (none on the first
  // stage: h is the embeddings), to this stage's (h, residual), or with `final_norm` (the
  // last stage) to the final hidden states and the residual stream.
  std::tuple<at::Tensor, at::Tensor> forward_stage(
      at::Tensor h, const OptTensor& residual_in, const at::Tensor& positions,
      const std::vector<std::pair<at::Tensor, at::Tensor>>& kv_caches,
      const std::vector<at::Tensor>& slot_mappings, const std::vector<at::Tensor>& block_tables,
      const std::vector<int64_t>& layer_groups, const at::Tensor& seq_ids,
      const at::Tensor& kv_lens, bool final_norm) {
    TORCH_CHECK(!final_norm || norm_, "CpuDecoder: a final norm was asked for but not given");
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one (k, v) cache per layer expected");
    TORCH_CHECK(!slot_mappings.empty() && slot_mappings.size() == block_tables.size() &&
                    (layer_groups.empty() || layer_groups.size() == layers_.size()),
                "CpuDecoder: one slot mapping and block table per KV group, a group per layer");
    for (int64_t g : layer_groups)
      TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(slot_mappings.size()),
                  "CpuDecoder: a layer's KV group is out of range");
    at::Tensor residual = residual_in ? *residual_in : at::Tensor();
    const int threads = at::get_num_threads();
    if (threads < 2 || threads > cpus_ || at::in_parallel_region() ||
        h.size(0) > std::min(max_gemv_rows_, gemv::kMaxRows)) {
      h = layers(h, residual, positions, kv_caches, slot_mappings, block_tables, layer_groups,
                 seq_ids, kv_lens, final_norm);
      return {h, residual};
    }
    team::with_team(threads, [&] {
      h = layers(h, residual, positions, kv_caches, slot_mappings, block_tables, layer_groups,
                 seq_ids, kv_lens, final_norm);
    });
    return {h, residual};
  }

 private:
  // `residual`: the stream so far (undefined before the first layer), advanced in place.
  at::Tensor layers(at::Tensor h, at::Tensor& residual, const at::Tensor& positions,
                    const std::vector<std::pair<at::Tensor, at::Tensor>>& kv_caches,
                    const std::vector<at::Tensor>& slot_mappings,
                    const std::vector<at::Tensor>& block_tables,
                    const std::vector<int64_t>& layer_groups, const at::Tensor& seq_ids,
                    const at::Tensor& kv_lens, bool final_norm) const {
    const int64_t T = h.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    Workspace ws;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      h = enter(h, residual, layer.in_norm);
      const at::Tensor qkv = linear(h, layer.qkv, ws.rows(ws.qkv, T, layer.qkv.n, h));
      if (!qkv.is_same(ws.q_of)) {  // views of the buffer: made once a step
        ws.q_of = qkv;
        ws.q = qkv.narrow(1, 0, q_size).view({T, heads_, head_dim_});
        ws.k = qkv.narrow(1, q_size, kv_size).view({T, kv_heads_, head_dim_});
        ws.v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads_, head_dim_});
      }
      const at::Tensor &q = ws.q, &k = ws.k, &v = ws.v;
      if (layer.q_norm) {
        const auto qn = layer.qk_norm_full ? q.view({T, 1, q_size}) : q;
        const auto kn = layer.qk_norm_full ? k.view({T, 1, kv_size}) : k;
        head_rms_norm(qn, qn, *layer.q_norm, eps_);
        head_rms_norm(kn, kn, *layer.k_norm, eps_);
      }
      if (layer.cos) rotary(positions, q, k, *layer.cos, *layer.sin);
      const at::Tensor& attn = ws.rows(ws.attn, T, q_size, h);
      if (!ws.attn_heads.defined() || !ws.attn_heads.is_alias_of(attn))
        ws.attn_heads = attn.view({T, heads_, head_dim_});
      const size_t g = layer_groups.empty() ? 0 : layer_groups[i];
      paged_attention(ws.attn_heads, q, k, v, kv_caches[i].first, kv_caches[i].second,
                      slot_mappings[g], block_tables[g], seq_ids, kv_lens, scale_, layer.window,
                      layer.soft_cap);
      h = leave(linear(attn, layer.o, ws.rows(ws.h, T, layer.o.n, h)), layer.attn_out_norm,
                layer.multiplier);
      h = enter(h, residual, layer.mlp_in_norm);
      const at::Tensor gate_up =
          linear(h, layer.gate_up, ws.rows(ws.gate_up, T, layer.gate_up.n, h));
      const at::Tensor& act = ws.rows(ws.act, T, gate_up.size(1) / 2, h);
      if (layer.gelu) {
        gelu_tanh_and_mul(act, gate_up);
      } else {
        silu_and_mul(act, gate_up);
      }
      h = leave(linear(act, layer.down, ws.rows(ws.h, T, layer.down.n, h)), layer.mlp_out_norm,
                layer.multiplier);
    }
    if (final_norm) add_norm(h, residual, norm_);
    return h;
  }

  // Into a sub-layer: residual += h (the first layer's residual is h), then its input is
  // norm(residual), written over h, or the residual itself without a norm.
  at::Tensor enter(at::Tensor h, at::Tensor& residual, const NormWeight& norm) const {
    if (!residual.defined()) {
      residual = h;
      if (!norm) return residual;
      auto out = at::empty_like(residual);
      this->norm(out, residual, norm);
      return out;
    }
    if (norm) {
      add_norm(h, residual, norm);
      return h;
    }
    residual.add_(h);
    return residual;
  }

  // Out of a sub-layer: its output normalized (post-norm families) and scaled.
  at::Tensor leave(at::Tensor h, const NormWeight& norm, double multiplier) const {
    if (norm) {
      auto out = at::empty_like(h);
      this->norm(out, h, norm);
      h = out;
    }
    if (multiplier != 1.0) h.mul_(multiplier);
    return h;
  }

  // out = norm(x), rows of x and out contiguous float32 like the weight.
  void norm(const at::Tensor& out, const at::Tensor& x, const NormWeight& w) const {
    check_rows(x, w);
    check_rows(out, w);
    rms_norm_rows(out.data_ptr<float>(), x.data_ptr<float>(), w.data, x.numel() / w.size,
                  w.size, static_cast<float>(eps_));
  }

  // residual += x, then x = norm(residual).
  void add_norm(const at::Tensor& x, const at::Tensor& residual, const NormWeight& w) const {
    check_rows(x, w);
    check_rows(residual, w);
    TORCH_CHECK(residual.numel() == x.numel(), "CpuDecoder: residual and hidden states differ");
    add_rms_norm_rows(x.data_ptr<float>(), residual.data_ptr<float>(), w.data,
                      x.numel() / w.size, w.size, static_cast<float>(eps_));
  }

  static void check_rows(const at::Tensor& t, const NormWeight& w) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.size(-1) == w.size,
                "CpuDecoder: hidden states must be contiguous float32 rows of the norm's size");
  }

  // x @ w (+ the step's adapters), into `out` [T, w.n] where the kernel writes in place (a
  // new tensor otherwise); x is never `out`.
  at::Tensor linear(const at::Tensor& x, const Linear& w, const at::Tensor& out) const {
    at::Tensor y;
    if (w.group < 0) {
      // ggml blocks: the parts, then their types (csrc/ggml_cpu.cpp); the GEMV writes into out.
      const std::vector<at::Tensor> parts(w.weights.begin(), w.weights.end() - 1);
      y = ggml::ggml_linear(x, parts, w.weights.back(), w.bias,
                            x.size(0) <= ggml::kMaxRows ? std::optional(out) : std::nullopt,
                            activation_bits_ == 8 ? 8 : 32);
    } else if (w.group == 0) {
      // The GEMV writes into `out`; more rows keep f32_linear's choice of GEMM (given an
      // output, it would take its own GEMM where oneDNN is faster for long prefills).
      y = gemv::f32_linear(x, w.weights[0], w.bias,
                           x.size(0) <= gemv::kMaxRows ? std::optional(out) : std::nullopt);
    } else if (activation_bits_ == 32 && x.size(0) <= max_gemv_rows_ &&
               x.scalar_type() == at::kFloat && x.is_contiguous() &&
               x.size(1) == w.awq.shape.K) {
      // The float GEMV on the operands checked at add_layer, into the step's buffer.
      awq_gemv_rows(x.data_ptr<float>(), x.size(0), w.awq, out.data_ptr<float>());
      y = out;
    } else {
      y = awq_linear(x, w.weights[0], w.weights[1], w.weights[2], w.bias, w.n, w.group,
                     activation_bits_ == 8 ? kInt8GemvMaxRows : max_gemv_rows_,
                     activation_bits_);
    }
    if (w.lora_a.defined()) {
      // Each run of rows with one adapter: y += (x @ a[slot]) @ b[slot].
      for (const auto& [slot, start, end] : segments_) {
        if (end - start <= kLoRALoopRows && x.stride(1) == 1 && y.stride(1) == 1) {
          lora_rows(y, x, w.lora_a[slot], w.lora_b[slot], start, end, w.shards, w.lora_rank);
        } else {
          y.narrow(0, start, end - start)
              .addmm_(x.narrow(0, start, end - start).mm(w.lora_a[slot]), w.lora_b[slot]);
        }
      }
    }
    return y;
  }

  int64_t heads_, kv_heads_, head_dim_;
  double scale_, eps_;
  int64_t max_gemv_rows_;
  int64_t activation_bits_;  // of the AWQ GEMVs: 32 (float), 16 or 8 (awq_activations)
  NormWeight norm_;
  int cpus_;  // team::usable_cpus() when built: read once, not a system call per step
  std::vector<Layer> layers_;
  std::vector<LoRASegment> segments_;
};
