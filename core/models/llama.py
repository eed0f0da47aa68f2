"""The Llama family (Llama, Mistral, Qwen2, SmolLM) as a textbook decoder.

    x -> embed -> N x [x + attn(rmsnorm(x)); x + mlp(rmsnorm(x))] -> rmsnorm -> lm_head

Parameter names follow Hugging Face, except that q/k/v and gate/up are fused into one
matmul each (`qkv_proj`, `gate_up_proj`); `load_weights` maps checkpoint names onto them.

The residual stream is carried beside each sub-layer's output and added inside the next
norm, so that a fused kernel can do both. Norms, RoPE and the MLP's activation compute in
torch, or, after `use_kernels` (float32 on CPU), in C++ (csrc/layer_ops_cpu.cpp).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pkv.core.attention import AttentionBackend, AttentionMetadata
from pkv.core.linear import Linear, LinearMethod, LinearSplit, as_tensor, check_shape, take
from pkv.core.model_config import ModelConfig
from pkv.core.parallel import ShardPlan, single_rank_plan


class RMSNorm(nn.Module):
    kernel: Any = None  # the compiled layer ops, set by `use_kernels`

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            out = torch.empty_like(x)
            self.kernel.rms_norm(out, x, self.weight, self.eps)
            return out
        # Normalize in float32 whatever the dtype, as transformers does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the kernel writes both in place."""
        if self.kernel is not None:
            self.kernel.add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self.forward(residual), residual


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of RoPE, with linear or llama3-style scaling when the config asks."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    kernel: Any = None  # the compiled layer ops, set by `use_kernels`

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.cfg, self.max_len = cfg, max_len
        self.register_buffer("cos", torch.empty(max_len, cfg.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_len, cfg.head_dim), persistent=False)
        self.reset()

    def reset(self) -> None:
        """(Re)compute the cos/sin tables in float32, e.g. after building on the meta device."""
        device = self.cos.device
        if device.type == "meta":
            return
        positions = torch.arange(self.max_len, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, rope_inv_freq(self.cfg).to(device))
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_len, head_dim]
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernel is not None:  # rotates q and k in place
            self.kernel.rotary(positions, q, k, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _split(plan: ShardPlan, kind: str, *slices: tuple[int, int]) -> LinearSplit | None:
    return LinearSplit(kind, slices, plan.tp) if plan.tp.enabled else None


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor parallelism)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 method: LinearMethod | None, plan: ShardPlan) -> None:
        super().__init__()
        d = self.head_dim = cfg.head_dim
        (q_start, self.num_heads), (kv_start, self.num_kv_heads) = plan.q_heads, plan.kv_heads
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        q_rows, kv_rows = (q_start * d, self.q_size), (kv_start * d, self.kv_size)
        self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                               cfg.attention_bias, method,
                               split=_split(plan, "column", q_rows, kv_rows, kv_rows))
        self.o_proj = Linear(self.q_size, [cfg.hidden_size], False, method,
                             split=_split(plan, "row", q_rows))
        self.scale = self.head_dim**-0.5
        self.backend = backend

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    kernel: Any = None  # the compiled layer ops, set by `use_kernels`

    def __init__(self, cfg: ModelConfig, method: LinearMethod | None, plan: ShardPlan) -> None:
        super().__init__()
        rows = plan.intermediate
        size = rows[1]
        self.gate_up_proj = Linear(cfg.hidden_size, [size, size], False, method,
                                   split=_split(plan, "column", rows, rows))
        self.down_proj = Linear(size, [cfg.hidden_size], False, method,
                                split=_split(plan, "row", rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernel is not None:
            h = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
            self.kernel.silu_and_mul(h, gate_up)
            return self.down_proj(h)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 method: LinearMethod | None, plan: ShardPlan) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, method, plan)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, method, plan)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope: RotaryEmbedding, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """`h` is the previous layer's output, not yet added to the residual stream (the
        first layer gets the embeddings and no residual); returns this layer's likewise."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm.add_forward(h, residual)
        h = self.self_attn(h, positions, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class VocabEmbedding(nn.Module):
    """Token embedding over this rank's slice of the vocabulary; ranks sum their rows."""

    def __init__(self, hidden: int, plan: ShardPlan) -> None:
        super().__init__()
        self.start, self.count = plan.vocab
        self.tp = plan.tp
        self.weight = nn.Parameter(torch.empty(self.count, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.count)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def load(self, tensor: object, name: str) -> None:
        rows = take(tensor, 0, self.start, self.count) if self.tp.enabled else as_tensor(tensor)
        check_shape(self.weight, rows, name)
        self.weight.copy_(rows)


class LlamaModel(nn.Module):
    fused: Any = None  # the whole stack in C++ (core/fused_decoder.py), set by `use_kernels`

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_len: int,
                 method: LinearMethod | None, plan: ShardPlan) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.hidden_size, plan)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, method, plan)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg, max_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        if self.fused is not None:
            return self.fused.forward(h, positions, kv_caches, meta.slot_mapping,
                                      meta.block_tables, meta.seq_ids, meta.kv_lens)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, positions, self.rotary_emb, kv_cache, meta)
        return self.norm.add_forward(h, residual)[0]


# checkpoint module name -> (fused module name, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_UNSTACKED = {value: key for key, value in _STACKED.items()}


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; `forward` returns hidden states, `compute_logits` the logits.

    `method` decides how the decoder's linear layers store weights (float, AWQ, FP8); the
    embedding and the LM head stay in the compute dtype. `plan` says which slice of every
    split dimension this rank holds (everything, without tensor parallelism).
    """

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_len: int,
                 method: LinearMethod | None = None, plan: ShardPlan | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.plan = plan or single_rank_plan(cfg)
        self.model = LlamaModel(cfg, backend, max_len, method, self.plan)
        self.lm_head = Linear(cfg.hidden_size, [self.plan.vocab[1]], False,
                              split=_split(self.plan, "column", self.plan.vocab))
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head where the config says so (again after
        `to_empty`, which unties)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def use_kernels(self, ops: Any, fused: Any = None) -> None:
        """Compute norms, RoPE and the MLP activation with `ops` (csrc/layer_ops_cpu.cpp,
        float32 on CPU only), and the whole decoder stack with `fused` where given (see
        core/fused_decoder.py); None goes back to torch."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding, MLP)):
                module.kernel = ops
        self.model.fused = fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [num_sampled, this rank's vocab]
        return self.plan.tp.all_gather_last_dim(logits, self.plan.vocab_sizes)

    def _expected_tensors(self) -> dict[tuple[str, str, int | None], str]:
        """(module, parameter, shard) -> the checkpoint name that must fill it."""
        expected = {}
        for path, module in self.named_modules():
            if path == "lm_head" and self.config.tie_word_embeddings:
                continue
            if isinstance(module, Linear):
                shards = range(len(module.out_sizes)) if len(module.out_sizes) > 1 else [None]
                for leaf in module.layouts:
                    for shard in shards:
                        expected[(path, leaf, shard)] = checkpoint_name(path, leaf, shard)
            elif not isinstance(module, LlamaForCausalLM):
                for leaf, _ in module.named_parameters(recurse=False):
                    expected[(path, leaf, None)] = f"{path}.{leaf}"
        return expected

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into place; all must be set. Then let
        each linear layer convert what it loaded."""
        modules = dict(self.named_modules())
        missing = self._expected_tensors()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            path, _, leaf = name.rpartition(".")
            base, _, part = path.rpartition(".")
            fused, shard = _STACKED.get(part, (part, None))
            path = f"{base}.{fused}" if base else fused
            module = modules.get(path)
            if isinstance(module, Linear):
                module.load(leaf, tensor, shard, name)
            elif isinstance(module, VocabEmbedding) and leaf == "weight":
                module.load(tensor, name)
            elif module is not None and isinstance(module._parameters.get(leaf), nn.Parameter):
                param, tensor = module._parameters[leaf], as_tensor(tensor)
                check_shape(param, tensor, name)
                param.copy_(tensor)
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            missing.pop((path, leaf, shard), None)
        if missing:
            names = sorted(missing.values())
            raise ValueError(f"checkpoint lacks {len(names)} tensor(s), e.g. {names[:3]}")
        for module in self.modules():
            if isinstance(module, Linear):
                module.method.process_weights_after_loading(module)


def checkpoint_name(path: str, leaf: str, shard: int | None) -> str:
    if shard is not None:
        base, _, fused = path.rpartition(".")
        path = f"{base}.{_UNSTACKED[(fused, shard)]}"
    return f"{path}.{leaf}"
