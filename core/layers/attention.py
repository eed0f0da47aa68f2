"""Self-attention over the paged KV cache, with the options families add to Llama's:
q/k norms (per head, or over the whole projection), RoPE or none, a sliding window, logit
soft-capping and a scale other than 1/sqrt(head_dim)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pkv.core.distributed.parallel import ShardPlan
from pkv.core.layers.attention_backend import AttentionBackend, AttentionMetadata
from pkv.core.layers.linear import Linear, LinearMethod, LinearSplit
from pkv.core.layers.norm import RMSNorm, SplitRMSNorm
from pkv.core.layers.rotary import RotaryEmbedding


def tp_split(plan: ShardPlan, kind: str, *slices: tuple[int, int]) -> LinearSplit | None:
    """The tensor-parallel cut of a linear layer (None without tensor parallelism)."""
    return LinearSplit(kind, slices, plan.tp) if plan.tp.enabled else None


@dataclass(frozen=True)
class AttentionOptions:
    """How one layer's attention differs from Llama's (the defaults are Llama's)."""

    bias: bool = False  # on q, k and v
    o_bias: bool = False  # on the output projection
    scale: float | None = None  # None: head_dim ** -0.5
    sliding_window: int | None = None  # keys within this many positions, the query included
    logits_soft_cap: float | None = None  # scores -> cap * tanh(scores / cap)
    qk_norm: str | None = None  # "head": RMSNorm over each head; "full": over all heads
    qk_norm_cls: type[RMSNorm] = RMSNorm
    norm_eps: float = 1e-6


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor parallelism)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope: RotaryEmbedding | None, backend: AttentionBackend,
                 method: LinearMethod | None, plan: ShardPlan,
                 options: AttentionOptions = AttentionOptions()) -> None:
        super().__init__()
        d = self.head_dim = head_dim
        (q_start, self.num_heads), (kv_start, self.num_kv_heads) = plan.q_heads, plan.kv_heads
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        q_rows, kv_rows = (q_start * d, self.q_size), (kv_start * d, self.kv_size)
        self.qkv_proj = Linear(hidden_size, [self.q_size, self.kv_size, self.kv_size],
                               options.bias, method,
                               split=tp_split(plan, "column", q_rows, kv_rows, kv_rows))
        self.o_proj = Linear(self.q_size, [hidden_size], options.o_bias, method,
                             split=tp_split(plan, "row", q_rows))
        self.scale = options.scale if options.scale is not None else d**-0.5
        self.sliding_window = options.sliding_window
        self.logits_soft_cap = options.logits_soft_cap
        self.qk_norm = options.qk_norm
        if options.qk_norm == "head":
            self.q_norm = options.qk_norm_cls(d, options.norm_eps)
            self.k_norm = options.qk_norm_cls(d, options.norm_eps)
        elif options.qk_norm == "full" and plan.tp.enabled:  # each rank holds its heads
            self.q_norm = SplitRMSNorm(num_heads * d, q_rows, options.norm_eps, plan.tp)
            self.k_norm = SplitRMSNorm(num_kv_heads * d, kv_rows, options.norm_eps, plan.tp)
        elif options.qk_norm == "full":
            self.q_norm = options.qk_norm_cls(self.q_size, options.norm_eps)
            self.k_norm = options.qk_norm_cls(self.kv_size, options.norm_eps)
        self.rotary_emb = rope
        self.backend = backend

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:
            rows = self.rotary_emb.table_positions(positions, meta.total_lens, meta.seq_ids)
            q, k = self.rotary_emb(rows, q, k)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                                   sliding_window=self.sliding_window,
                                   logits_soft_cap=self.logits_soft_cap)
        return self.o_proj(out.reshape(-1, self.q_size))
