"""AWQ 4-bit GEMM in Triton: y = x @ W for AutoAWQ "GEMM" checkpoints, W never materialized.

Layout (group size G, 8 nibbles per int32 along the output dim N):
    x        [M, K]     float16 / bfloat16 / float32
    qweight  [K, N/8]   int32   nibble i of column c holds output column 8c + [0,2,4,6,1,3,5,7][i]
    qzeros   [K/G, N/8] int32   packed like qweight
    scales   [K/G, N]   float16 / bfloat16 / float32
    W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]

Each program owns a [BLOCK_M, BLOCK_N] tile of y and walks K in BLOCK_K steps that never cross
a group, so one row of zeros and scales serves a whole step. Accumulation is float32; on CPU
it runs only under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _awq_gemm_kernel(
    y_ptr, x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, M, N, K,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    packed_cols = N // 8
    col = rn // 8
    # Column 8c+j sits in nibble [0,4,1,5,2,6,3,7][j] = (j % 2) * 4 + j // 2.
    j = rn % 8
    shifts = ((j % 2) * 4 + j // 2) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = (k0 + rk).to(tl.int64)
        x = tl.load(x_ptr + rm[:, None] * K + ks[None, :], mask=m_mask[:, None], other=0.0)
        q = tl.load(qweight_ptr + ks[:, None] * packed_cols + col[None, :],
                    mask=n_mask[None, :], other=0)  # [BLOCK_K, BLOCK_N], 8 lanes per int32
        q = (q >> shifts[None, :]) & 0xF
        group = k0 // GROUP_SIZE
        z = tl.load(qzeros_ptr + group * packed_cols + col, mask=n_mask, other=0)
        z = (z >> shifts) & 0xF
        s = tl.load(scales_ptr + group * N + rn, mask=n_mask, other=0.0).to(tl.float32)
        w = (q - z[None, :]).to(tl.float32) * s[None, :]
        # Half-precision x multiplies half-precision W (tensor cores); float32 stays exact.
        acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], y, mask=m_mask[:, None] & n_mask[None, :])


def _check_shapes(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
                  scales: torch.Tensor, group_size: int) -> None:
    """Raise ValueError naming the first tensor that does not fit the AWQ GEMM layout."""
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be a 2-D float16/bfloat16/float32 tensor, got "
                         f"{tuple(x.shape)} {x.dtype}")
    k = x.shape[1]
    if scales.dim() != 2 or scales.dtype not in _FLOAT_DTYPES or scales.shape[1] % 8:
        raise ValueError(f"scales must be a 2-D float [K/G, N] tensor with N a multiple of 8, "
                         f"got {tuple(scales.shape)} {scales.dtype}")
    n = scales.shape[1]
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (k, n // 8):
        raise ValueError(f"qweight must be int32 [K={k}, N/8={n // 8}], got "
                         f"{tuple(qweight.shape)} {qweight.dtype}")
    # tl.dot needs K steps of at least 16 that never cross a group.
    if group_size <= 0 or group_size % 16 or k % group_size:
        raise ValueError(f"group_size {group_size} must be a positive multiple of 16 that "
                         f"divides K={k} (x.shape[1])")
    groups = k // group_size
    if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, n // 8):
        raise ValueError(f"qzeros must be int32 [K/G={groups}, N/8={n // 8}], got "
                         f"{tuple(qzeros.shape)} {qzeros.dtype}")
    if scales.shape[0] != groups:
        raise ValueError(f"scales must have K/G={groups} rows, got {tuple(scales.shape)}")
    devices = {t.device for t in (x, qweight, qzeros, scales)}
    if len(devices) != 1:
        raise ValueError(f"x, qweight, qzeros and scales must share a device, got {devices}")


def awq_gemm_triton(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
                    scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """y = x @ dequant(qweight, qzeros, scales), AutoAWQ GEMM layout; [M, N] in x.dtype."""
    _check_shapes(x, qweight, qzeros, scales, group_size)
    x, qweight = x.contiguous(), qweight.contiguous()
    qzeros, scales = qzeros.contiguous(), scales.contiguous()
    m, k = x.shape
    n = qweight.shape[1] * 8
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n = 64
    block_k = 32 if group_size % 32 == 0 else 16
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _awq_gemm_kernel[grid](y, x, qweight, qzeros, scales, m, n, k, GROUP_SIZE=group_size,
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
