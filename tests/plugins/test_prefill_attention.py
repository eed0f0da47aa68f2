"""The CPU paged-attention kernel's tiled prefill path (runs of consecutive tokens of one
sequence) against a float64 reference built from gathered K/V, under every ISA flavour this
CPU runs: long chunks whose sizes are no multiple of the tiles, cached prefixes, shuffled
physical blocks, several sequences mixing decodes, short chunks and long prefills, GQA, head
sizes of the tiled (multiple of 16) and scalar paths, sliding windows and soft-capping."""

from __future__ import annotations

import pytest
import torch

from pkv.csrc import cpp_build
from pkv.plugins.attention.layouts import random_paged_layout

pytestmark = pytest.mark.skipif(bool(cpp_build.unusable_reasons()),
                                reason="the CPU kernels cannot be built here")

SCALE = 0.125


def _reference(q, k, v, k_cache, v_cache, meta, window: int, cap: float) -> torch.Tensor:
    """Plain softmax attention per sequence, from K/V gathered through the block table."""
    kc = k_cache.clone().view(-1, *k_cache.shape[2:])
    vc = v_cache.clone().view(-1, *v_cache.shape[2:])
    kc[meta.slot_mapping], vc[meta.slot_mapping] = k, v
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q, dtype=torch.float64)
    seq_ids, kv_lens = meta.seq_ids.tolist(), meta.kv_lens.tolist()
    for s in sorted(set(seq_ids)):
        rows = [t for t, i in enumerate(seq_ids) if i == s]
        n = max(kv_lens[t] for t in rows)
        table = meta.block_tables[s].long()
        slots = table[torch.arange(n) // bs] * bs + torch.arange(n) % bs
        keys = kc[slots].double().repeat_interleave(group, 1)  # [n, H, D]
        vals = vc[slots].double().repeat_interleave(group, 1)
        lens = torch.tensor([kv_lens[t] for t in rows])
        pos = torch.arange(n)
        visible = pos[None, :] < lens[:, None]
        if window > 0:
            visible &= pos[None, :] >= (lens - window)[:, None]
        scores = torch.einsum("thd,nhd->htn", q[rows].double(), keys) * SCALE
        if cap > 0:
            scores = torch.tanh(scores / cap) * cap
        scores = scores.masked_fill(~visible, float("-inf"))
        out[rows] = torch.einsum("htn,nhd->thd", scores.softmax(-1), vals)
    return out.float()


# [(cached tokens, new tokens)], decodes first as the engine orders them
LAYOUTS = {
    "prefill": [(0, 523)],
    "cached_prefix": [(301, 389)],
    "mixed": [(77, 1), (400, 1), (5, 9), (0, 300), (129, 181), (2, 17)],
}


# (layout, heads, kv heads, head size, window, soft cap): head sizes 64, 48 (a multiple of 16
# that no flavour's register blocking divides), 16 and 24 (the per-token scalar path)
CASES = [
    *[(layout, 6, kvh, 64, 0, 0.0) for layout in LAYOUTS for kvh in (6, 2)],
    ("cached_prefix", 6, 2, 48, 0, 0.0),
    ("mixed", 4, 4, 16, 0, 0.0),
    *[(layout, 6, 2, 64, window, cap) for layout in ("cached_prefix", "mixed")
      for window, cap in ((37, 0.0), (0, 2.0), (150, 5.0))],
    ("prefill", 6, 6, 48, 100, 0.0),
    ("mixed", 6, 2, 24, 37, 2.0),
]


@pytest.mark.parametrize("flavour", cpp_build.runnable_flavours())
@pytest.mark.parametrize("layout, heads, kv_heads, head_dim, window, cap", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_prefill_matches_reference(flavour: str, layout: str, heads: int, kv_heads: int,
                                   head_dim: int, window: int, cap: float):
    kernels = cpp_build.kernels(flavour)
    block_size = 16
    q, k, v, k_cache, v_cache, meta = random_paged_layout(
        LAYOUTS[layout], block_size, heads, kv_heads, head_dim, seed=head_dim + heads)
    q = q * 2  # scores wide enough for the softmax and the cap to matter
    # q/k/v as strided views of one fused qkv, as the models pass them
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
    hq, hk = heads * head_dim, kv_heads * head_dim
    q = qkv[:, :hq].view_as(q)
    k = qkv[:, hq:hq + hk].view_as(k)
    v = qkv[:, hq + hk:].view_as(v)
    expected = _reference(q, k, v, k_cache, v_cache, meta, window, cap)
    out = torch.empty(q.shape)
    kernels.paged_attention(out, q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                            meta.seq_ids, meta.kv_lens, SCALE, window, cap)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("flavour", cpp_build.runnable_flavours())
def test_window_never_reads_blocks_before_it(flavour: str):
    """Blocks wholly before the first new token's window may be back in the pool: fill them
    with NaN; the tiled path must not read them."""
    kernels = cpp_build.kernels(flavour)
    window, block_size = 40, 8
    q, k, v, k_cache, v_cache, meta = random_paged_layout(
        [(200, 150)], block_size, 4, 2, 32, seed=3)
    expected = _reference(q, k, v, k_cache, v_cache, meta, window, 0.0)
    first_needed = (200 + 1 - window) // block_size
    for b in meta.block_tables[0, :first_needed].tolist():
        k_cache[b], v_cache[b] = float("nan"), float("nan")
    out = torch.empty(q.shape)
    kernels.paged_attention(out, q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                            meta.seq_ids, meta.kv_lens, SCALE, window, 0.0)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("flavour", cpp_build.runnable_flavours())
@pytest.mark.parametrize("sharpness, atol", [(12.0, 3e-5), (30.0, 8e-5)])
def test_prefill_with_sharp_scores(flavour: str, sharpness: float, atol: float):
    """Scores up to ~130 apart: many softmax terms underflow (the tiled path's exp of a term
    below -87 is 0), rows are dominated by a few keys, and the running max jumps from tile to
    tile; the result must still match the reference (to within the float32 scores' own
    rounding, which grows with their size)."""
    kernels = cpp_build.kernels(flavour)
    q, k, v, k_cache, v_cache, meta = random_paged_layout(
        [(150, 300), (0, 70)], 16, 6, 2, 64, seed=5)
    q = q * sharpness
    expected = _reference(q, k, v, k_cache, v_cache, meta, 0, 0.0)
    out = torch.empty(q.shape)
    kernels.paged_attention(out, q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                            meta.seq_ids, meta.kv_lens, SCALE, 0, 0.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("flavour", cpp_build.runnable_flavours())
def test_a_nan_key_makes_exactly_the_rows_that_see_it_nan(flavour: str):
    """A NaN must not vanish in the softmax: the rows whose keys include it come out NaN, the
    rows before it stay the reference's."""
    kernels = cpp_build.kernels(flavour)
    q, k, v, k_cache, v_cache, meta = random_paged_layout([(0, 200)], 16, 6, 2, 64, seed=7)
    k = k.clone()
    k[150, 1] = float("nan")
    expected = _reference(q, k, v, k_cache, v_cache, meta, 0, 0.0)
    out = torch.empty(q.shape)
    kernels.paged_attention(out, q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                            meta.seq_ids, meta.kv_lens, SCALE, 0, 0.0)
    assert out[150:, 3:6].isnan().all() and not out[150:, :3].isnan().any()
    torch.testing.assert_close(out[:150], expected[:150], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out[150:, :3], expected[150:, :3], atol=2e-5, rtol=1e-4)
