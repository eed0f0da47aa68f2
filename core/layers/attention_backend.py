"""The attention backend interface and the per-step metadata every backend reads.

A step's tokens arrive flattened: the first `num_decode_tokens` rows are single-token queries
(decodes), the rest are the prefill chunks, one contiguous run per sequence.

    slot = block_table[pos // block_size] * block_size + pos % block_size

KV cache per layer: k_cache, v_cache of shape [num_blocks, block_size, num_kv_heads, row]:
rows of head_dim values, or of head_dim 8-bit codes and a float32 scale (core/layers/kv_format.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pkv.core.layers.kv_format import write_rows


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token's K/V goes and which blocks each sequence attends over."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: cached + new tokens per sequence
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    num_decode_tokens: int  # decodes come first, one token each
    seq_ids: torch.Tensor  # [num_tokens] int32: the sequence each token belongs to
    kv_lens: torch.Tensor  # [num_tokens] int32: keys each token attends to (position + 1)
    # Host copies, so backends that loop over prefills never synchronize with the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # [num_seqs] int32: each sequence's whole length, prompt and outputs, computed or not
    # (more than seq_lens during a chunked prefill); LongRoPE picks its table by it
    total_lens: torch.Tensor | None = None
    # With several KV groups (core/layers/kv_groups.py): this step's metadata for each group
    # (its own slot_mapping and block_tables; the fields above are group 0's), and the group
    # each layer reads.
    groups: tuple[AttentionMetadata, ...] = ()
    layer_groups: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def for_layer(self, i: int) -> AttentionMetadata:
        """What layer i's attention reads: its KV group's slots and tables."""
        return self.groups[self.layer_groups[i]] if self.groups else self


class AttentionBackend(ABC):
    """Writes new K/V into cache slots, then attends over each sequence's blocks.

    All of a step's K/V are written before any attention, so a sequence may attend over
    blocks that another sequence in the same step is filling (shared prefixes).
    """

    name: str = "base"

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k/v at meta.slot_mapping, then attend causally over the block tables.

        With `sliding_window`, a token at position p sees keys p - window + 1 .. p only;
        blocks wholly before that may have gone back to the pool (their table entries are
        stale) and must not be read. With `logits_soft_cap`, scores (after `scale`) become
        cap * tanh(score / cap) before the softmax.
        """

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store each token's K/V at its slot, in the cache's format."""
        write_rows(k_cache, slot_mapping, k)
        write_rows(v_cache, slot_mapping, v)
