"""Tensor parallelism on torch.distributed: how a model is split over ranks, and the
collectives the split layers use.

Attention heads are split by KV-head groups (a rank holds whole groups of query heads with
their KV heads), the MLP by intermediate channels, the embedding and LM head by vocabulary.
Splits need not be even: SmolLM2's 3 KV heads go 2 + 1 over two ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist


class ModelSizes(Protocol):
    """The sizes a split is planned from (pkv.core.models.config.ModelConfig has them; it
    sits above the layers that take a ShardPlan, so it is not imported here)."""

    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    num_experts: int
    moe_intermediate_size: int


def split(total: int, parts: int, rank: int) -> tuple[int, int]:
    """(start, count) of `rank`'s contiguous share of `total` units; shares differ by <= 1."""
    base, extra = divmod(total, parts)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group (size 1: no parallelism)."""

    rank: int = 0
    size: int = 1
    # The group's process group (None: the whole world; a pipeline stage has its own).
    group: Any = field(default=None, compare=False, repr=False)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (ranks may hold different sizes)."""
        if not self.enabled:
            return x
        width = max(sizes)
        padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


def check_tp_size(cfg: ModelSizes, tp: int) -> None:
    """Errors a user understands when the model cannot be split `tp` ways."""
    if tp > cfg.num_key_value_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} exceeds the model's {cfg.num_key_value_heads} KV heads: "
            f"each rank needs at least one KV head (use at most {cfg.num_key_value_heads})")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(f"{cfg.num_attention_heads} attention heads do not divide into "
                         f"{cfg.num_key_value_heads} KV-head groups")
    if tp > cfg.intermediate_size or tp > cfg.vocab_size:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the MLP width or the vocabulary")
    if cfg.num_experts and tp > cfg.moe_intermediate_size:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the experts' intermediate size "
                         f"({cfg.moe_intermediate_size})")


@dataclass(frozen=True)
class ShardPlan:
    """What one rank holds of each split dimension, as (start, count) in checkpoint units."""

    tp: TPGroup
    kv_heads: tuple[int, int]
    q_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_sizes: list[int]  # every rank's vocabulary count, for gathering logits
    moe_intermediate: tuple[int, int] = (0, 0)  # of each expert's channels (MoE models)

    @classmethod
    def build(cls, cfg: ModelSizes, tp: TPGroup) -> ShardPlan:
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        kv_start, kv_count = split(cfg.num_key_value_heads, tp.size, tp.rank)
        return cls(tp=tp, kv_heads=(kv_start, kv_count),
                   q_heads=(kv_start * group, kv_count * group),
                   intermediate=split(cfg.intermediate_size, tp.size, tp.rank),
                   vocab=split(cfg.vocab_size, tp.size, tp.rank),
                   vocab_sizes=[split(cfg.vocab_size, tp.size, r)[1] for r in range(tp.size)],
                   moe_intermediate=split(cfg.moe_intermediate_size, tp.size, tp.rank))


def single_rank_plan(cfg: ModelSizes) -> ShardPlan:
    return ShardPlan.build(cfg, TPGroup())
