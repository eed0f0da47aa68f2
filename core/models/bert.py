"""BERT encoders: embedding models (`BertModel`) and cross-encoders
(`BertForSequenceClassification`), as a textbook.

    x = LayerNorm(word + position + token_type embeddings)
    N x [x = LayerNorm(x + attn(x)); x = LayerNorm(x + ffn(x))]      (post-norm, GELU)

Attention is bidirectional within each prompt, so an encoder keeps no KV cache: every
prompt runs whole in one step, each attending over its own rows.
Parameter names are Hugging Face's, so a checkpoint loads by name (with or without the
`bert.` prefix that the classification checkpoints carry).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pkv.core.distributed.parallel import ShardPlan, single_rank_plan
from pkv.core.layers.attention_backend import AttentionBackend, AttentionMetadata
from pkv.core.layers.embedding import VocabEmbedding
from pkv.core.layers.ggml_linear import GGMLLinearMethod, sixteen_bit_blocks
from pkv.core.layers.ggml_tensor import GGMLTensor
from pkv.core.layers.linear import Linear, LinearMethod, as_tensor, check_shape
from pkv.core.models.config import ModelConfig

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class Dense(nn.Linear):
    """nn.Linear, computed by the CPU kernels' float32 linear where given (`use_kernels`):
    oneDNN's GEMM there ran BERT's shapes 1.2-1.4x as fast as torch's addmm (2-vCPU Zen 5)."""

    kernel: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None or x.dtype != torch.float32 or x.dim() != 2:
            return super().forward(x)
        return self.kernel.f32_linear(x, self.weight, self.bias, None)


def keeps_blocks(cfg: ModelConfig, method: LinearMethod | None) -> bool:
    """Whether the encoder's weights stay in ggml blocks: where the runner chose that method
    and every linear's inputs are whole 32-value blocks, the kernels' unit (a TinyBERT's
    312-wide layers are widened to float32 at load instead)."""
    widths = (cfg.hidden_size, cfg.intermediate_size)
    return isinstance(method, GGMLLinearMethod) and all(w % 32 == 0 for w in widths)


def dense(d_in: int, d_out: int, method: LinearMethod | None) -> nn.Module:
    """One of the encoder's linears: float32 (`Dense`), or a `Linear` whose weights stay in
    ggml blocks (a GGUF's, or a 16-bit checkpoint's) at their own size, where the runner
    chose that method (`keeps_blocks`); float32 activations either way."""
    return Dense(d_in, d_out) if method is None else Linear(d_in, [d_out], True, method)


@dataclass(frozen=True, slots=True)
class Prompts:
    """Where a step's prompts lie in its rows: prompt i is rows [starts[i], starts[i + 1])."""

    starts: torch.Tensor  # int64 [prompts + 1]
    lens: list[int]

    @classmethod
    def of(cls, starts: list[int]) -> Prompts:
        return cls(torch.tensor(starts, dtype=torch.int64),
                   [b - a for a, b in zip(starts, starts[1:])])


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, eps: float, in_blocks: bool) -> None:
        super().__init__()
        # The word table stays in blocks where the linears do: it is about half of a small
        # encoder's weights (all-MiniLM-L6: 11.7M of 22.7M).
        self.word_embeddings = (VocabEmbedding(cfg.hidden_size, single_rank_plan(cfg))
                                if in_blocks else nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.hf.get("type_vocab_size", 2),
                                                  cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        x = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
             + self.position_embeddings(positions))
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    kernel: Any = None  # the CPU kernels, for their bidirectional attention (`use_kernels`)

    def __init__(self, hidden: int, heads: int, method: LinearMethod | None) -> None:
        super().__init__()
        self.heads = heads
        self.query = dense(hidden, hidden, method)
        self.key = dense(hidden, hidden, method)
        self.value = dense(hidden, hidden, method)

    def forward(self, x: torch.Tensor, prompts: Prompts) -> torch.Tensor:
        shape = (x.shape[0], self.heads, -1)
        q, k, v = (proj(x).view(shape) for proj in (self.query, self.key, self.value))
        if self.kernel is not None and q.shape[-1] % 16 == 0:
            out = self.kernel.bidirectional_attention(q, k, v, prompts.starts,
                                                      q.shape[-1] ** -0.5)
        else:
            out = bidirectional_attention(q, k, v, prompts.lens)
        return out.reshape(x.shape[0], -1)


class BertOutput(nn.Module):
    """LayerNorm(residual + dense(x)): both sub-layers end so (post-norm)."""

    def __init__(self, d_in: int, hidden: int, eps: float, method: LinearMethod | None) -> None:
        super().__init__()
        self.dense = dense(d_in, hidden, method)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dense(x))


class BertAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float, method: LinearMethod | None) -> None:
        super().__init__()
        self.self = BertSelfAttention(hidden, heads, method)
        self.output = BertOutput(hidden, hidden, eps, method)

    def forward(self, x: torch.Tensor, prompts: Prompts) -> torch.Tensor:
        return self.output(self.self(x, prompts), x)


class BertIntermediate(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str,
                 method: LinearMethod | None) -> None:
        super().__init__()
        self.dense = dense(hidden, intermediate, method)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, eps: float, method: LinearMethod | None) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.attention = BertAttention(h, cfg.num_attention_heads, eps, method)
        self.intermediate = BertIntermediate(h, cfg.intermediate_size, cfg.hidden_act, method)
        self.output = BertOutput(cfg.intermediate_size, h, eps, method)

    def forward(self, x: torch.Tensor, prompts: Prompts) -> torch.Tensor:
        x = self.attention(x, prompts)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, eps: float, method: LinearMethod | None) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, eps, method)
                                   for _ in range(cfg.num_hidden_layers))


class BertPooler(nn.Module):
    """tanh(dense(CLS row)): the classifier's input."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_rows))


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            seq_lens: list[int]) -> torch.Tensor:
    """Each prompt's rows attend to all of its own rows: [tokens, heads, dim] in and out; in
    torch, where the CPU kernels' one call for all prompts is not at hand (it took 64
    sentences of 8-64 words' six layers from ~24 to ~10 ms, 2-vCPU Zen 5). One SDPA call a
    prompt on its own rows: padding a step's prompts into one masked batch spent more on the
    padding (zero fills, masked flash attention: 9 ms a layer for those 64 sentences) than the
    prompts' attention itself. Each call is 4-D, a batch of one: torch's CPU flash kernel
    takes only 4-D inputs, and its math fallback took twice as long (~13 ms a layer against
    ~7)."""
    out = torch.empty_like(q)
    start = 0
    for n in seq_lens:
        rows = slice(start, start + n)
        out[rows] = F.scaled_dot_product_attention(
            *(t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v)))[0].transpose(0, 1)
        start += n
    return out


class BertEmbeddingModel(nn.Module):
    """`BertModel`: the encoder's last hidden states, for the pooler to pool."""

    keeps_kv = False  # bidirectional: no KV cache, every prompt whole in one step
    default_pooling = "cls"  # without sentence-transformers' files (see core/pooling)
    # What ModelConfig.from_hf_dict asks every family (RoPE and ties do not apply here).
    required_fields: tuple[str, ...] = ("intermediate_size",)
    default_rope_theta = 10000.0
    default_tie_word_embeddings = False
    qkv_bias = False

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_len: int,
                 method: LinearMethod | None = None, plan: ShardPlan | None = None) -> None:
        super().__init__()
        self.config = cfg
        eps = float(cfg.hf.get("layer_norm_eps", 1e-12))
        if not keeps_blocks(cfg, method):
            method = None
        self.embeddings = BertEmbeddings(cfg, eps, method is not None)
        self.encoder = BertEncoder(cfg, eps, method)

    @classmethod
    def configure(cls, config: ModelConfig, hf: dict[str, Any]) -> None:
        kind = hf.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"config field position_embedding_type={kind!r} is not supported "
                             "(pkv runs absolute positions)")
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"config field hidden_act={config.hidden_act!r} is not one of "
                             f"{', '.join(_ACTIVATIONS)}")
        if hf.get("is_decoder") or hf.get("add_cross_attention"):
            raise ValueError("a BERT decoder (is_decoder / add_cross_attention) is not an "
                             "encoder pkv runs")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        prompts = Prompts.of(meta.query_start_loc_cpu)
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, prompts)
        return x

    # --- what the runner and loader call on every model ---------------------------------

    def use_kernels(self, ops: Any) -> None:
        """Compute the encoder's linears and attention with the CPU kernels (None: torch)."""
        for module in self.encoder.modules():
            if isinstance(module, (Dense, BertSelfAttention)):
                module.kernel = ops

    def tie_weights(self) -> None:
        """Nothing is tied in an encoder."""

    def reset_buffers(self) -> None:
        """An encoder has no derived buffers."""

    def _renamed(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith("pooler.") and not hasattr(self, "pooler"):
                continue  # BertModel checkpoints carry a pooler that embeddings do not use
            if name.endswith("position_ids"):
                continue  # an old checkpoint's buffer, recomputed here
            yield name, tensor

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy checkpoint tensors into place by name; every parameter must be set once. A
        `Linear`'s weights go to its method (kept in blocks); the rest is float32."""
        params = dict(self.named_parameters())
        linears = {path: m for path, m in self.named_modules() if isinstance(m, Linear)}
        missing = set(params) | {f"{path}.weight" for path in linears}
        for name, tensor in self._renamed(weights):
            path, _, leaf = name.rpartition(".")
            if path in linears and name in missing:
                linears[path].load(leaf, tensor, None, name)
            elif name == "embeddings.word_embeddings.weight" and isinstance(
                    self.embeddings.word_embeddings, VocabEmbedding):
                self.embeddings.word_embeddings.load(sixteen_bit_blocks(tensor), name)
            elif name in params:
                param = params[name]
                tensor = (tensor.dequantize() if isinstance(tensor, GGMLTensor)
                          else as_tensor(tensor))
                check_shape(param, tensor, name)
                param.copy_(tensor)
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            missing.discard(name)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. "
                             f"{sorted(missing)[:3]}")
        for layer in linears.values():
            layer.method.process_weights_after_loading(layer)


class BertForSequenceClassification(BertEmbeddingModel):
    """A cross-encoder: the pair's CLS row -> pooler -> classifier logits."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_len: int,
                 method: LinearMethod | None = None, plan: ShardPlan | None = None) -> None:
        super().__init__(cfg, backend, max_len, method, plan)
        self.pooler = BertPooler(cfg.hidden_size)
        labels = cfg.hf.get("num_labels") or len(cfg.hf.get("id2label") or {}) or 2
        self.classifier = nn.Linear(cfg.hidden_size, labels)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """Logits [rows, labels] of the pooled CLS rows."""
        return self.classifier(self.pooler(cls_rows))
