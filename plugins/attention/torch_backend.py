"""Reference attention backend in plain torch: runs on any device, favours clarity."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pkv.core.layers.attention_backend import AttentionBackend, AttentionMetadata
from pkv.core.layers.kv_format import dequantize_rows


def _gather(cache: torch.Tensor, block_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # [..., num_blocks] -> [..., num_blocks * block_size, num_kv_heads, head_dim] in `dtype`
    blocks = dequantize_rows(cache[block_table], dtype)
    return blocks.flatten(-4, -3)


def _soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    return scores if cap is None else torch.tanh(scores / cap) * cap


class TorchAttentionBackend(AttentionBackend):
    """Gathers each sequence's blocks and runs dense attention over them."""

    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta, scale, sliding_window,
                                   logits_soft_cap)
        if nd < q.shape[0]:
            out[nd:] = self.prefill(q, k_cache, v_cache, meta, scale, sliding_window,
                                    logits_soft_cap)[nd:]
        return out

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
               logits_soft_cap: float | None = None) -> torch.Tensor:
        nd, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        seq_lens = meta.seq_lens[:nd]
        num_blocks = (max(meta.seq_lens_cpu[:nd]) + k_cache.shape[1] - 1) // k_cache.shape[1]
        block_tables = meta.block_tables[:nd, :num_blocks]
        k = _gather(k_cache, block_tables, q.dtype).permute(0, 2, 3, 1)  # [nd, kvh, hd, L]
        v = _gather(v_cache, block_tables, q.dtype).transpose(1, 2)  # [nd, kvh, L, hd]
        q = q.view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = _soft_cap(torch.matmul(q, k) * scale, logits_soft_cap)  # [nd, kvh, group, L]
        positions = torch.arange(scores.shape[-1], device=q.device)
        lens = seq_lens[:, None].to(positions.dtype)
        invalid = positions[None, :] >= lens  # [nd, L]
        if sliding_window is not None:
            invalid |= positions[None, :] < lens - sliding_window
        scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, v).view(nd, num_heads, head_dim)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        out = torch.zeros_like(q)
        block_size = k_cache.shape[1]
        first = meta.num_decode_tokens  # decodes are one token, one sequence each
        for i in range(first, meta.num_seqs):
            start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            seq_len = meta.seq_lens_cpu[i]
            table = meta.block_tables[i, : (seq_len + block_size - 1) // block_size]
            k = _gather(k_cache, table, q.dtype)[:seq_len].transpose(0, 1)  # [kvh, L, hd]
            v = _gather(v_cache, table, q.dtype)[:seq_len].transpose(0, 1)
            out[start:end] = self._causal(q[start:end].transpose(0, 1), k, v, scale,
                                          sliding_window, logits_soft_cap)
        return out

    @staticmethod
    def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        # q: [heads, q_len, hd]; k, v: [kv_heads, L, hd]; queries are the last q_len positions.
        q_len, kv_len = q.shape[1], k.shape[1]
        if sliding_window is None and logits_soft_cap is None and q_len == kv_len:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                 enable_gqa=True)
            return out.transpose(0, 1)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        visible = k_pos <= q_pos  # [q_len, L]
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        if logits_soft_cap is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale,
                                                 enable_gqa=True)
            return out.transpose(0, 1)
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = _soft_cap(torch.matmul(q, k.transpose(1, 2)) * scale, logits_soft_cap)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.matmul(probs, v).transpose(0, 1)
