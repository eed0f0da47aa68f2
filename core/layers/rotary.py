"""Rotary position embeddings (RoPE) and the scalings configs ask for.

    q' = q * cos(pos * f) + rotate_half(q) * sin(pos * f)   on the first `rotary_dim` dims

Scalings: default, linear, llama3 and longrope (`su`, Phi-3): LongRoPE keeps two tables,
short factors for sequences up to `original_max_position_embeddings` and long ones beyond,
chosen per sequence as transformers chooses per forward (by the sequence's length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su")


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE: base, scaling (`rope_type` plus its parameters) and how many dims rotate."""

    theta: float
    rotary_dim: int
    scaling: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 2048

    @property
    def kind(self) -> str:
        return self.scaling.get("rope_type") or self.scaling.get("type") or "default"

    @property
    def long_threshold(self) -> int | None:
        """Sequences longer than this use LongRoPE's long factors (None: one table)."""
        if self.kind in ("longrope", "su"):  # (transformers' default: the model's length)
            return int(self.scaling.get("original_max_position_embeddings")
                       or self.max_position_embeddings)
        return None


def rope_inv_freq(spec: RopeSpec, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], factor applied to cos and sin)."""
    dim, s = spec.rotary_dim, spec.scaling
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (spec.theta ** exponents)
    kind = spec.kind
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / s["factor"], 1.0
    if kind == "llama3":
        factor = s["factor"]
        low, high = s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind in ("longrope", "su"):
        original = spec.long_threshold
        factor = s.get("factor") or spec.max_position_embeddings / original
        attention = s.get("attention_factor")
        if attention is None:
            attention = (1.0 if factor <= 1.0
                         else math.sqrt(1 + math.log(factor) / math.log(original)))
        ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * spec.theta ** exponents), float(attention)
    raise ValueError(f"rope scaling type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")


class RotaryEmbedding(nn.Module):
    """cos/sin tables in float32; `forward` rotates q [T, H, D] and k [T, KVH, D]."""

    kernel: Any = None  # the compiled layer ops, set by `use_kernels`

    def __init__(self, spec: RopeSpec, head_dim: int, max_len: int) -> None:
        super().__init__()
        self.spec, self.head_dim, self.max_len = spec, head_dim, max_len
        rows = max_len * (2 if spec.long_threshold is not None else 1)
        self.register_buffer("cos", torch.empty(rows, spec.rotary_dim), persistent=False)
        self.register_buffer("sin", torch.empty(rows, spec.rotary_dim), persistent=False)
        self.reset()

    def reset(self) -> None:
        """(Re)compute the tables, e.g. after building on the meta device."""
        device = self.cos.device
        if device.type == "meta":
            return
        positions = torch.arange(self.max_len, dtype=torch.float32, device=device)
        cos, sin = [], []
        for long in ([False, True] if self.spec.long_threshold is not None else [False]):
            inv_freq, factor = rope_inv_freq(self.spec, long)
            freqs = torch.outer(positions, inv_freq.to(device))
            emb = torch.cat([freqs, freqs], dim=-1)  # [max_len, rotary_dim]
            cos.append(emb.cos() * factor)
            sin.append(emb.sin() * factor)
        self.cos, self.sin = torch.cat(cos), torch.cat(sin)

    def table_positions(self, positions: torch.Tensor, total_lens: torch.Tensor | None,
                        seq_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the tables for each token: LongRoPE's long table for tokens of sequences
        whose whole length (`total_lens`, prompt and outputs, not just this step's chunk) is
        over the threshold, as transformers computes the whole sequence with one table; the
        position itself otherwise."""
        threshold = self.spec.long_threshold
        if threshold is None:
            return positions
        if total_lens is None:
            raise ValueError("LongRoPE needs each sequence's length (AttentionMetadata.total_lens)")
        long = total_lens.to(positions.device)[seq_ids.long()] > threshold
        return positions + long.to(positions.dtype) * self.max_len

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernel is not None and q.dtype == torch.float32:
            self.kernel.rotary(positions, q, k, self.cos, self.sin)  # in place
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, rotary_dim]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
