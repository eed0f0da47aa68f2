"""4-bit weights in the layout of the CPU's 4-bit kernel (csrc/awq_cpu.cpp): W[k, n] =
codes[k, n] * scales[g, n] - zs[g, n] for input k in group g, 32 output columns per tile; an
empty zs stands for 8 * scales (a GGUF's Q4_0: 5 bits a weight held instead of 6). A GGUF's
Q4_K keeps its own form instead (`k4_tiled`): 6-bit scale and min codes per group under a
float scale per 256 inputs, 4.75 bits a weight.

AWQ checkpoints repack into it (plugins/weights/awq.py), and so do a GGUF's 4-bit types
(Q4_0, Q4_1, Q4_K: core/layers/ggml_linear.py), whose blocks are groups of 32 inputs.
"""

from __future__ import annotations

from typing import Any

import torch

PACK = 8  # codes per int32 word
KERNEL_TILE = 32  # output columns per tile of the CPU kernel


def repack_words(codes: torch.Tensor) -> torch.Tensor:
    """[K, N] codes -> the CPU kernel's int32 [N'/32, K/8, 32]: 32 output columns per tile,
    8 inputs per word, input 8b+i in the 4 bits from (3 + 4i) mod 32 up, wrapping past bit 31
    (see csrc/awq_cpu.cpp); N' = N rounded up to 32, padded with zero codes."""
    k, n = codes.shape
    nibbles = pad_columns(codes.to(torch.int32), n).reshape(k // PACK, PACK, -1, KERNEL_TILE)
    words = torch.zeros(k // PACK, nibbles.shape[2], KERNEL_TILE, dtype=torch.int32)
    for i in range(PACK):  # [K/8, N'/32, 32] at a time: no large temporaries
        q, start = nibbles[:, i], (3 + 4 * i) % 32
        words |= q << start if start <= 28 else (q << start) | (q >> (32 - start))
    return words.permute(1, 0, 2).contiguous()


def by_tile(t: torch.Tensor) -> torch.Tensor:
    """[R, N'] -> [N'/32, R, 32]: each kernel tile's rows next to each other."""
    return t.reshape(t.shape[0], -1, KERNEL_TILE).permute(1, 0, 2).contiguous()


def pad_columns(t: torch.Tensor, n: int) -> torch.Tensor:
    padded = t.new_zeros(t.shape[0], -(-n // KERNEL_TILE) * KERNEL_TILE)
    padded[:, :n] = t
    return padded


def tiled(codes: torch.Tensor, scales: torch.Tensor,
          zs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's (codes, scales, zs) of codes [K, N] and float scales / zs [K/G, N]; zs
    None: 8 * scales, left to the kernel (an empty zs)."""
    n = codes.shape[1]
    return (repack_words(codes), by_tile(pad_columns(scales.float(), n)),
            by_tile(pad_columns(zs.float(), n)) if zs is not None else torch.empty(0))


def k4_tiled(codes: torch.Tensor, sc: torch.Tensor, mins: torch.Tensor, d: torch.Tensor,
             dmin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's Q4_K form of codes [K, N]: W = codes (d sc) - dmin mins, with the 6-bit
    sc and mins [K/32, N] per group and d, dmin [K/256, N] per super-block; as (codes,
    uint8 [N'/32, K/32, 2, 32] sc then mins, float32 [N'/32, K/256, 2, 32] d then dmin)."""
    n = codes.shape[1]

    def pairs(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.stack([by_tile(pad_columns(t.to(dtype), n)) for t in (a, b)], dim=2)

    return repack_words(codes), pairs(sc, mins, torch.uint8), pairs(d, dmin, torch.float32)


def gemv_rows(kernel: Any, activation_bits: int) -> int:
    """Rows up to which the 4-bit kernel's GEMV takes a layer rather than its GEMM (awq_linear's
    `max_gemv_rows`): with int8 activations the int8 GEMV's own limit, else the float one's."""
    return kernel.awq_int8_max_rows if activation_bits == 8 else kernel.awq_gemv_max_rows
