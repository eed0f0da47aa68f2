"""Every attention backend usable here against a dense float64 reference, on random paged
layouts: shuffled physical blocks, ragged lengths, GQA, block sizes 1/16/32, prefill over a
cached prefix, and decode; and over 8-bit and 16-bit caches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pkv.core.layers.attention_backend import AttentionBackend
from pkv.core.layers.kv_format import dequantize_rows, quantize_rows
from pkv.core.registry import discover, select_attention_backend
from pkv.plugins.attention.layouts import random_paged_layout

# On a GPU machine the same tests run every backend usable there on CUDA tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = discover().usable_attention_backends(DEVICE)


def _dense_reference(q, k, v, k_cache, v_cache, meta, scale):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_cache.view(-1, *k_cache.shape[2:])[meta.slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[meta.slot_mapping] = v
    bs = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q, dtype=torch.float64)
    for t in range(q.shape[0]):
        s, n = int(meta.seq_ids[t]), int(meta.kv_lens[t])
        table = meta.block_tables[s]
        slots = [int(table[p // bs]) * bs + p % bs for p in range(n)]
        keys = k_cache.view(-1, *k_cache.shape[2:])[slots].double()  # [n, kvh, d]
        vals = v_cache.view(-1, *v_cache.shape[2:])[slots].double()
        keys = keys.repeat_interleave(group, dim=1)
        vals = vals.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[t].double(), keys) * scale
        out[t] = torch.einsum("hn,nhd->hd", scores.softmax(-1), vals)
    return out.float()


LAYOUTS = {
    "decode": [(37, 1), (5, 1), (120, 1), (16, 1)],
    "prefill": [(0, 23), (0, 7), (0, 40)],
    "cached-prefix": [(48, 1), (32, 9), (17, 30)],
    "mixed": [(40, 1), (3, 1), (0, 12), (33, 20)],
}


def _reference_cases() -> list[tuple[str, int, str]]:
    """(backend, block size, layout) to check. Triton interpreted on CPU runs one program per
    (token, KV head) in Python, ~25 s a case at block size 1 (a loop turn per key): there it
    takes block size 1 (paging by single tokens) on the decode layout only, whose single
    kernel is the one every layout runs; block sizes 16 and 32 cover the other layouts."""
    interpreted = DEVICE == "cpu"
    # (128: Triton takes such a block in tiles of 32 keys, a whole one not fitting a GPU's
    # shared memory)
    return [(name, bs, layout) for name in BACKENDS for bs in (1, 16, 32, 128)
            for layout in LAYOUTS
            if not (name == "triton" and interpreted and bs == 1 and layout != "decode")]


@pytest.mark.parametrize("backend_name,block_size,layout", _reference_cases())
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)], ids=["gqa", "mha"])
def test_backend_matches_dense_reference(backend_name: str, block_size: int, layout: str,
                                         heads: int, kv_heads: int):
    backend = select_attention_backend(backend_name, DEVICE)
    q, k, v, k_cache, v_cache, meta = random_paged_layout(
        LAYOUTS[layout], block_size, heads, kv_heads, 64, seed=block_size, device=DEVICE)
    expected = _dense_reference(q, k, v, k_cache, v_cache, meta, 0.125)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    # K/V of the step were written into their slots.
    assert torch.equal(k_cache.view(-1, kv_heads, 64)[meta.slot_mapping], k)


def test_expected_backends_are_usable_here():
    assert "torch" in BACKENDS and "triton" in BACKENDS
    assert DEVICE == "cuda" or "cpu" in BACKENDS


@pytest.mark.skipif("cpu" not in BACKENDS, reason="no C++ compiler: the cpu backend is absent")
@pytest.mark.parametrize("head_dim", [16, 40, 64, 128])  # vector paths (16, 64, 128), scalar (40)
@pytest.mark.parametrize("seqs", [[(70, 1)], [(3, 1), (50, 1)], [(20, 1)] * 9],
                         ids=["one-token", "two-tokens", "nine-tokens"])
def test_cpu_kernel_head_sizes_and_work_splits(head_dim: int, seqs: list[tuple[int, int]],
                                               isa: str):
    # One or two tokens split work per (token, KV head), more per token: both must agree.
    backend = select_attention_backend("cpu", "cpu")
    q, k, v, k_cache, v_cache, meta = random_paged_layout(seqs, 16, 12, 3, head_dim, seed=head_dim)
    expected = _dense_reference(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


# Decodes long enough that the cpu kernel cuts a sequence's keys into parts and merges them.
LONG_DECODES = {"one-long": [(700, 1)], "two-mixed": [(520, 1), (130, 1)],
                "batch": [(2100, 1), (40, 1), (600, 1), (257, 1), (90, 1)]}


@pytest.mark.skipif("cpu" not in BACKENDS, reason="no C++ compiler: the cpu backend is absent")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqs", list(LONG_DECODES.values()), ids=list(LONG_DECODES))
def test_cpu_decode_of_long_sequences_in_parts(head_dim: int, seqs: list[tuple[int, int]],
                                               isa: str, two_threads):
    # Parts of a sequence's keys run on either thread and are merged after; the result is the
    # whole softmax, and the same whether the token came alone, in a batch, or on one thread.
    backend = select_attention_backend("cpu", "cpu")
    q, k, v, k_cache, v_cache, meta = random_paged_layout(seqs, 16, 9, 3, head_dim, seed=7)
    q = q * 4  # peaked scores: a part's running max is far from another's
    expected = _dense_reference(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    torch.set_num_threads(1)
    assert torch.equal(backend.forward(q, k, v, k_cache, v_cache, meta, head_dim**-0.5), out)
    torch.set_num_threads(2)
    first = dataclasses.replace(  # the batch's first token on its own
        meta, slot_mapping=meta.slot_mapping[:1], seq_ids=meta.seq_ids[:1],
        kv_lens=meta.kv_lens[:1], query_start_loc=meta.query_start_loc[:2],
        query_start_loc_cpu=meta.query_start_loc_cpu[:2], seq_lens=meta.seq_lens[:1],
        seq_lens_cpu=meta.seq_lens_cpu[:1], num_decode_tokens=1)
    alone = backend.forward(q[:1], k[:1], v[:1], k_cache, v_cache, first, head_dim**-0.5)
    assert torch.equal(alone, out[:1])


@pytest.mark.skipif("cpu" not in BACKENDS, reason="no C++ compiler: the cpu backend is absent")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_cpu_decode_drops_softmax_terms_below_2_to_the_minus_64(cache_dtype: torch.dtype,
                                                                isa: str):
    # Kept, such terms seed subnormal floats (an int8 row's scale times vexp's e^-87.3 floor),
    # and each multiply-add on one takes a microcode assist on Intel. One decode over 48 keys
    # in three blocks, scores set through the first dimension alone (exact in int8): e^-60
    # before the max (dropped by the rescaling), the max 0, e^-40 after it (kept), the rest
    # -200. Values large enough that each term would show: 1e24 x e^-60 = 8.8e-3.
    backend = select_attention_backend("cpu", "cpu")
    q, k, v, k_cache, v_cache, meta = random_paged_layout([(47, 1)], 16, 1, 1, 64, seed=3)
    scores, values = torch.full((48,), -200.0), torch.ones(48)
    scores[[3, 20, 33]] = torch.tensor([-60.0, 0.0, -40.0])
    values[[3, 33]] = torch.tensor([1e24, 1e15])
    q.zero_()[0, 0, 0] = 8.0  # times the scale 1/8: a key's first value is its score
    table = meta.block_tables[0].long()
    slots = table[torch.arange(48) // 16] * 16 + torch.arange(48) % 16
    rows_k, rows_v = torch.zeros(48, 1, 64), values.view(48, 1, 1).expand(48, 1, 64)
    rows_k[:, 0, 0] = scores
    k_cache.view(-1, 1, 64)[slots] = rows_k
    v_cache.view(-1, 1, 64)[slots] = rows_v.contiguous()
    k.copy_(rows_k[47:]), v.copy_(rows_v[47:])
    k_cache, v_cache = quantize_rows(k_cache, cache_dtype), quantize_rows(v_cache, cache_dtype)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125)
    kept = (1 + 1e15 * torch.tensor(-40.0, dtype=torch.float64).exp()) / (
        1 + torch.tensor(-40.0, dtype=torch.float64).exp())
    torch.testing.assert_close(out, torch.full_like(out, float(kept)), rtol=1e-5, atol=0)
    assert float(kept) - 1 > 4e-3  # the e^-40 term shows; the e^-60 one would add 8.8e-3


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_backend_reads_q_k_v_as_views_of_one_fused_qkv(backend_name: str):
    # The model passes split views of its qkv projection (strided rows), not copies.
    backend = select_attention_backend(backend_name, DEVICE)
    q, k, v, k_cache, v_cache, meta = random_paged_layout(
        LAYOUTS["mixed"], 16, 9, 3, 64, seed=3, device=DEVICE)
    expected = _dense_reference(q, k, v, k_cache, v_cache, meta, 0.125)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=-1)
    q2, k2, v2 = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    out = backend.forward(q2.view(q.shape), k2.view(k.shape), v2.view(v.shape), k_cache,
                          v_cache, meta, 0.125)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(v_cache.view(-1, 3, 64)[meta.slot_mapping], v)


@pytest.mark.parametrize("backend_name", [n for n in BACKENDS
                                          if not (n == "triton" and DEVICE == "cpu")])
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_rows_too_small_to_scale_are_stored_as_zeros(backend_name: str,
                                                     cache_dtype: torch.dtype):
    # A row of values below ~1e-36 has a subnormal scale; dividing by it overflowed the codes
    # (e4m3's NaN in the C++ writer, a saturated code in torch's).
    backend = select_attention_backend(backend_name, DEVICE)
    q, k, v, k_cache, v_cache, meta = random_paged_layout(
        LAYOUTS["mixed"], 16, 9, 3, 64, seed=5, device=DEVICE)
    k, v = k * 1e-37, v * 1e-38
    k_cache, v_cache = quantize_rows(k_cache, cache_dtype), quantize_rows(v_cache, cache_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    AttentionBackend.write_kv(k, v, k_ref, v_ref, meta.slot_mapping)
    backend.forward(q, k, v, k_cache, v_cache, meta, 0.125)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    for cache in (k_cache, v_cache):
        written = dequantize_rows(cache.view(-1, *cache.shape[2:])[meta.slot_mapping])
        assert torch.equal(written, torch.zeros_like(written))


def _dequantized_reference(q, k, v, k_cache, v_cache, meta, scale):
    """The dense reference over what a quantized cache holds once the step's K/V are in:
    the torch backend's own writes (quantize_rows), widened back to float32."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    AttentionBackend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    k_new = dequantize_rows(k_cache.view(-1, *k_cache.shape[2:])[meta.slot_mapping])
    v_new = dequantize_rows(v_cache.view(-1, *v_cache.shape[2:])[meta.slot_mapping])
    return _dense_reference(q, k_new, v_new, dequantize_rows(k_cache), dequantize_rows(v_cache),
                            meta, scale)


def _tolerance(backend_name: str, cache_dtype: torch.dtype) -> dict[str, float]:
    """How close a backend's output over a quantized cache is to the dense reference over the
    same cache widened: float32 rounding, except that the cpu backend's decode takes int8 keys
    in integer dot products with q rounded to int16 (2^-16 of a head's largest value)."""
    if backend_name == "cpu" and cache_dtype == torch.int8:
        return {"rtol": 1e-3, "atol": 2e-4}
    return {"rtol": 1e-4, "atol": 1e-5}


def _kv_dtype_cases() -> list[tuple[str, str, torch.dtype]]:
    """(backend, layout, cache dtype); interpreted Triton takes the mixed layout only."""
    dtypes = (torch.int8, torch.float8_e4m3fn, torch.bfloat16, torch.float16)
    return [(name, layout, dt) for name in BACKENDS for layout in LAYOUTS for dt in dtypes
            if not (name == "triton" and DEVICE == "cpu" and layout != "mixed")]


@pytest.mark.parametrize("backend_name,layout,cache_dtype", _kv_dtype_cases())
def test_backend_reads_and_writes_a_smaller_kv_cache(backend_name: str, layout: str,
                                                     cache_dtype: torch.dtype):
    backend = select_attention_backend(backend_name, DEVICE)
    q, k, v, k_cache, v_cache, meta = random_paged_layout(
        LAYOUTS[layout], 16, 9, 3, 64, seed=11, device=DEVICE)
    unquantized = _dense_reference(q, k, v, k_cache, v_cache, meta, 0.125)
    k_cache, v_cache = quantize_rows(k_cache, cache_dtype), quantize_rows(v_cache, cache_dtype)
    expected = _dequantized_reference(q, k, v, k_cache, v_cache, meta, 0.125)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    AttentionBackend.write_kv(k, v, k_ref, v_ref, meta.slot_mapping)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out, expected, **_tolerance(backend_name, cache_dtype))
    # What the cache's own rounding moves, the kernel's arithmetic moves far less.
    assert (out - expected).abs().max() < (expected - unquantized).abs().max() / 50
    # Every backend stores the very bytes the reference quantizer does.
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    # And the quantization error stays that of the format (vs the float32 cache's answer).
    exact = _dense_reference(q, k, v, dequantize_rows(k_cache), dequantize_rows(v_cache), meta,
                             0.125)
    bound = {torch.int8: 0.05, torch.float8_e4m3fn: 0.3, torch.bfloat16: 0.03,
             torch.float16: 0.005}[cache_dtype]
    assert (out - exact).abs().max() < bound


@pytest.mark.skipif("cpu" not in BACKENDS, reason="no C++ compiler: the cpu backend is absent")
@pytest.mark.parametrize("cache_dtype",
                         [torch.int8, torch.float8_e4m3fn, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 40, 64, 128])
def test_cpu_kernel_smaller_kv_cache_every_flavour(cache_dtype: torch.dtype, head_dim: int,
                                                   isa: str):
    # Decodes, a short chunk (per-token path) and a long one (tiled path), with a window.
    backend = select_attention_backend("cpu", "cpu")
    q, k, v, k_cache, v_cache, meta = random_paged_layout(
        [(70, 1), (3, 1), (20, 5), (9, 40)], 16, 12, 3, head_dim, seed=head_dim)
    k_cache, v_cache = quantize_rows(k_cache, cache_dtype), quantize_rows(v_cache, cache_dtype)
    reference = select_attention_backend("torch", "cpu")
    expected = reference.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta,
                                 head_dim**-0.5, sliding_window=24)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, head_dim**-0.5, sliding_window=24)
    torch.testing.assert_close(out, expected, **_tolerance("cpu", cache_dtype))
