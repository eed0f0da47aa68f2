"""The attention backend interface and the per-step metadata every backend reads.

A step's tokens arrive flattened: the first `num_decode_tokens` rows are single-token queries
(decodes), the rest are the prefill chunks, one contiguous run per sequence.

    slot = block_table[pos // block_size] * block_size + pos % block_size

KV cache per layer: k_cache, v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token's K/V goes and which blocks each sequence attends over."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: cached + new tokens per sequence
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    num_decode_tokens: int  # decodes come first, one token each
    # Host copies, so backends that loop over prefills never synchronize with the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """Writes new K/V into cache slots, then attends over each sequence's blocks."""

    name: str = "base"

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        # All of the step's K/V are written before any attention, so a sequence may attend
        # over blocks that another sequence in the same step is filling (shared prefixes).
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta, scale)
        if nd < q.shape[0]:
            out[nd:] = self.prefill(q, k_cache, v_cache, meta, scale)[nd:]
        return out

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store each token's K/V at its slot."""

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention for the first `num_decode_tokens` single-token queries."""

    @abstractmethod
    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention for the prefill rows (rows >= num_decode_tokens are used)."""
