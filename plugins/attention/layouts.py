"""Random paged-attention inputs, for backend tests and `pkv bench attention`."""

from __future__ import annotations

import torch

from pkv.core.layers.attention_backend import AttentionMetadata


def random_paged_layout(seqs: list[tuple[int, int]], block_size: int, heads: int,
                        kv_heads: int, dim: int, seed: int, device: str = "cpu"
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   torch.Tensor, AttentionMetadata]:
    """A step's attention inputs for `seqs` = [(cached tokens, new tokens)], decodes
    (new == 1) first; physical blocks are shuffled and the cache holds random values."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(need) + 3
    physical = torch.randperm(num_blocks, generator=g).tolist()  # shuffled blocks
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    tables, slots, seq_ids, kv_lens, qsl = [], [], [], [], [0]
    for i, (cached, new) in enumerate(seqs):
        table = [physical.pop() for _ in range(need[i])]
        tables.append(table)
        for pos in range(cached, cached + new):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            seq_ids.append(i)
            kv_lens.append(pos + 1)
        qsl.append(qsl[-1] + new)
    width = max(map(len, tables))
    bt = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    total = qsl[-1]
    q = torch.randn(total, heads, dim, generator=g)
    k = torch.randn(total, kv_heads, dim, generator=g)
    v = torch.randn(total, kv_heads, dim, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32), block_tables=bt,
        num_decode_tokens=sum(1 for c, n in seqs if n == 1 and c > 0),
        seq_ids=torch.tensor(seq_ids, dtype=torch.int32),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32), query_start_loc_cpu=qsl,
        seq_lens_cpu=[c + n for c, n in seqs])
    tensors = [t.to(device) for t in (q, k, v, k_cache, v_cache)]
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables", "seq_ids",
                 "kv_lens"):
        setattr(meta, name, getattr(meta, name).to(device))
    return (*tensors, meta)
