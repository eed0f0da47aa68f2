"""`triton` attention backend: one Triton kernel for paged decode and prefill (CUDA and ROCm).

Each program takes one query token and one KV head with the query heads that share it, walks
the sequence's blocks through the block table and keeps an online softmax. On CPU it runs
only under TRITON_INTERPRET=1 (how CI checks it against the reference).

8-bit caches (core/layers/kv_format.py) are read as bytes: int8 codes or fp8 e4m3 bit
patterns (decoded here with integer arithmetic, the same on every GPU and in the
interpreter), times the float32 scale stored at the end of each row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pkv.core.layers.attention_backend import AttentionBackend, AttentionMetadata
from pkv.core.layers.kv_format import is_scaled


@triton.jit
def _load_rows(ptr, scale_ptr, rows, d, valid, ROW: tl.constexpr, HEAD_DIM: tl.constexpr,
               SCALED: tl.constexpr, FP8: tl.constexpr):
    """Rows of the cache as float32 [len(rows), len(d)]: values, or codes times scales."""
    mask = valid[:, None] & (d[None, :] < HEAD_DIM)
    x = tl.load(ptr + rows[:, None] * ROW + d[None, :], mask=mask, other=0)
    if not SCALED:
        return x.to(tl.float32)
    if FP8:  # e4m3: 2^(e-7) * (1 + m/8), subnormal (e = 0) 2^-6 * m/8
        u = x.to(tl.int32) & 0xFF
        e = (u >> 3) & 0xF
        m = (u & 7).to(tl.float32)
        mag = tl.where(e > 0, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)), m * 0.001953125)
        x = tl.where(u >= 128, -mag, mag)
    else:
        x = x.to(tl.float32)
    scale = tl.load(scale_ptr + rows * (ROW // 4) + HEAD_DIM // 4, mask=valid, other=0.0)
    return x * scale[:, None]


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_ids_ptr,
    kv_lens_ptr, scale, stride_bt, window, soft_cap,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROW: tl.constexpr, SCALED: tl.constexpr, FP8: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, TILE: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + token).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + token)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, TILE)
    q_rows = token * NUM_HEADS + kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    num_blocks = tl.cdiv(kv_len, BLOCK_SIZE)
    first_key = 0
    if HAS_WINDOW:  # blocks wholly before the window are never read
        first_key = tl.maximum(kv_len - window, 0)
    for b in range(first_key // BLOCK_SIZE, num_blocks):
        block = tl.load(block_tables_ptr + seq * stride_bt + b).to(tl.int64)
        # A block in tiles of TILE keys: what one tile holds must fit the GPU's shared memory
        # (a whole block of 128 keys of 128 dims did not, on many cards).
        for t0 in tl.static_range(0, BLOCK_N, TILE):
            key = t0 + n
            pos = b * BLOCK_SIZE + key
            valid = (key < BLOCK_SIZE) & (pos < kv_len) & (pos >= first_key)
            rows = (block * BLOCK_SIZE + key) * NUM_KV_HEADS + kv_head
            k = _load_rows(k_ptr, k_scale_ptr, rows, d, valid, ROW, HEAD_DIM, SCALED, FP8)
            v = _load_rows(v_ptr, v_scale_ptr, rows, d, valid, ROW, HEAD_DIM, SCALED, FP8)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            if HAS_SOFT_CAP:  # cap * tanh(s / cap), tanh from exp
                e = tl.exp(-2.0 * tl.abs(s / soft_cap))
                t = (1.0 - e) / (1.0 + e)
                s = soft_cap * tl.where(s < 0, -t, t)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # (a tile wholly before the window, first: no key yet, nothing to subtract)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_ref[:, None])
            alpha = tl.exp(m - m_ref)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=q_mask)


def _pow2(x: int, at_least: int = 16) -> int:
    return max(at_least, triton.next_power_of_2(x))


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton; K/V are written with index_copy_."""

    name = "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        q = q.contiguous()
        out = torch.empty_like(q)
        num_tokens, num_heads, head_dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        block_tables = meta.block_tables.contiguous()
        scaled, fp8 = is_scaled(k_cache.dtype), k_cache.dtype == torch.float8_e4m3fn
        # fp8 rows go in as bytes (decoded in the kernel); scales as float32 views of the rows.
        k_rows = k_cache.view(torch.uint8) if fp8 else k_cache
        v_rows = v_cache.view(torch.uint8) if fp8 else v_cache
        k_scales = k_cache.view(torch.uint8).view(torch.float32) if scaled else k_cache
        v_scales = v_cache.view(torch.uint8).view(torch.float32) if scaled else v_cache
        _paged_attention_kernel[(num_tokens, num_kv_heads)](
            out, q, k_rows, v_rows, k_scales, v_scales, block_tables, meta.seq_ids, meta.kv_lens,
            scale, block_tables.stride(0), sliding_window or 0, logits_soft_cap or 0.0,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group,
            HEAD_DIM=head_dim, ROW=k_cache.shape[3], SCALED=scaled, FP8=fp8,
            BLOCK_SIZE=block_size, BLOCK_G=_pow2(group), BLOCK_N=_pow2(block_size),
            TILE=min(_pow2(block_size), 32 if head_dim <= 128 else 16),
            BLOCK_D=_pow2(head_dim), HAS_WINDOW=sliding_window is not None,
            HAS_SOFT_CAP=logits_soft_cap is not None)
        return out
