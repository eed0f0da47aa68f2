"""Sliding windows and logit soft-capping in every attention backend (cpu, torch, triton)
against a dense float64 reference, on random paged layouts mixing decodes and prefills over
cached prefixes. Table entries of blocks wholly before a sequence's window point at a block
of garbage, as they may once those blocks went back to the pool: no backend may read them."""

from __future__ import annotations

import pytest
import torch

from pkv.core.registry import discover, select_attention_backend
from pkv.plugins.attention.layouts import random_paged_layout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = [b for b in ("cpu", "torch", "triton")
            if b in discover().usable_attention_backends(DEVICE)]
HEADS, KV_HEADS, SCALE = 4, 2, 0.3  # small: triton runs interpreted on CPU
# head sizes 16 and 24: the cpu kernel's vector and scalar paths (interpreted triton: one)
CASES = [(b, d) for b in BACKENDS for d in (16, 24)
         if not (b == "triton" and DEVICE == "cpu" and d != 16)]

LAYOUTS = {
    # decodes first (one token each), then prefills: fresh, and chunks over a cached prefix
    "mixed": [(37, 1), (2, 1), (0, 12), (21, 9)],
    "decodes": [(37, 1), (2, 1)],  # the cpu kernel splits two tokens' work per KV head
}


def _hide_blocks_behind_window(k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                               window: int) -> None:
    """Point table entries wholly before each sequence's first needed key at a spare block
    filled with large values."""
    bs = k_cache.shape[1]
    used = set(meta.block_tables.flatten().tolist())
    spare = next(b for b in range(k_cache.shape[0]) if b not in used)
    k_cache[spare], v_cache[spare] = 1e3, -1e3
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        cached = seq_len - (qsl[i + 1] - qsl[i])
        first_key = max(0, cached - window + 1)  # the first new token's window starts here
        meta.block_tables[i, :first_key // bs] = spare


def _dense_reference(q, k, v, k_cache, v_cache, meta, window: int | None,
                     cap: float | None) -> torch.Tensor:
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_cache.view(-1, *k_cache.shape[2:])[meta.slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[meta.slot_mapping] = v
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q, dtype=torch.float64)
    for t in range(q.shape[0]):
        s, n = int(meta.seq_ids[t]), int(meta.kv_lens[t])  # the token sits at n - 1
        table = meta.block_tables[s]
        first = 0 if window is None else max(0, n - window)
        slots = [int(table[p // bs]) * bs + p % bs for p in range(first, n)]
        keys = k_cache.view(-1, *k_cache.shape[2:])[slots].double().repeat_interleave(group, 1)
        vals = v_cache.view(-1, *v_cache.shape[2:])[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[t].double(), keys) * SCALE
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        out[t] = torch.einsum("hn,nhd->hd", scores.softmax(-1), vals)
    return out.float()


@pytest.mark.parametrize("backend_name, head_dim", CASES)
@pytest.mark.parametrize("window", [None, 5], ids=["global", "window5"])
@pytest.mark.parametrize("cap", [None, 3.0], ids=["nocap", "cap3"])
@pytest.mark.parametrize("block_size", [4, 16, 64])  # 64: Triton's tiles of 32 keys, the
@pytest.mark.parametrize("layout", list(LAYOUTS))   # first of a block before the window
def test_window_and_soft_cap_match_dense_reference(backend_name: str, window: int | None,
                                                   cap: float | None, block_size: int,
                                                   head_dim: int, layout: str):
    _check_backend(backend_name, window, cap, block_size, head_dim, LAYOUTS[layout])


@pytest.mark.skipif("cpu" not in BACKENDS, reason="no C++ compiler: the cpu backend is absent")
@pytest.mark.parametrize("head_dim", [16, 24])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cpu_window_and_soft_cap_under_each_flavour(isa: str, head_dim: int, layout: str):
    _check_backend("cpu", 5, 3.0, 4, head_dim, LAYOUTS[layout])


@pytest.mark.skipif("cpu" not in BACKENDS, reason="no C++ compiler: the cpu backend is absent")
@pytest.mark.parametrize("window", [None, 600], ids=["global", "window600"])
def test_cpu_long_decodes_in_parts_with_window_and_cap(window: int | None, two_threads):
    # Keys cut into parts (the first part's block starting before the window), merged.
    _check_backend("cpu", window, 3.0, 16, 32, [(1500, 1), (700, 1), (300, 1)])


def _check_backend(backend_name: str, window: int | None, cap: float | None, block_size: int,
                   head_dim: int, seqs: list[tuple[int, int]]) -> None:
    backend = select_attention_backend(backend_name, DEVICE)
    q, k, v, k_cache, v_cache, meta = random_paged_layout(
        seqs, block_size, HEADS, KV_HEADS, head_dim, seed=head_dim + block_size, device=DEVICE)
    q = q * 3  # scores large enough for the cap of 3 to bend them
    if window is not None:
        _hide_blocks_behind_window(k_cache, v_cache, meta, window)
    expected = _dense_reference(q, k, v, k_cache, v_cache, meta, window, cap)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, SCALE, sliding_window=window,
                          logits_soft_cap=cap)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(k_cache.view(-1, KV_HEADS, head_dim)[meta.slot_mapping], k)


def test_reference_window_and_cap_change_the_result():
    # Neither option is inert on these inputs (else the test above would prove nothing).
    q, k, v, k_cache, v_cache, meta = random_paged_layout(LAYOUTS["mixed"], 4, HEADS,
                                                          KV_HEADS, 16, seed=20)
    q = q * 3
    plain = _dense_reference(q, k, v, k_cache, v_cache, meta, None, None)
    for window, cap in [(5, None), (None, 3.0)]:
        changed = _dense_reference(q, k, v, k_cache, v_cache, meta, window, cap)
        assert (changed - plain).abs().max() > 0.1


def test_every_backend_is_checked_here():
    assert {"torch", "triton"} <= set(BACKENDS)
    assert DEVICE == "cuda" or "cpu" in BACKENDS
