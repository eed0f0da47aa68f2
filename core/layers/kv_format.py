"""How K and V rows are stored in the paged cache: `--kv-cache-dtype`.

One row is one token's keys (or values) for one KV head. Three kinds of storage:

    float32 / bfloat16 / float16   [..., head_dim] of that dtype
    int8                           [..., head_dim + 4] int8: the codes, then a float32 scale
    fp8_e4m3                       [..., head_dim + 4] float8_e4m3fn: likewise

A scaled row holds x ~ scale * code with scale = max |x| / 127 (int8, codes rounded half to
even) or max |x| / 448 (fp8 e4m3, the format's largest finite value), one scale per token and
head: the cache is written a token at a time, and a scale per block would have to rescale
the codes already written whenever a larger value arrived. The scale's 4 bytes sit at the end
of the row they scale, so a block stays one slab of bytes (the pool, prefix caching,
preemption and offloading move blocks without knowing what they hold), and the dtype of the
cache tensor alone says how to read it (the C++ kernel, the torch reference and Triton alike).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pkv.core.config.engine import KV_CACHE_DTYPES

SCALE_BYTES = 4  # a float32 scale after the codes of each row
_FP8 = torch.float8_e4m3fn
_LARGEST = {torch.int8: 127.0, _FP8: 448.0}
_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "int8": torch.int8, "fp8_e4m3": _FP8, "fp8": _FP8}


@dataclass(frozen=True)
class KVFormat:
    """The cache's storage dtype and the width of its rows for `head_dim`."""

    name: str  # float32, bfloat16, float16, int8 or fp8_e4m3
    dtype: torch.dtype  # of the cache tensor
    head_dim: int

    @property
    def scaled(self) -> bool:
        return is_scaled(self.dtype)

    @property
    def row(self) -> int:
        """Elements of one row (codes and scale bytes for a scaled format)."""
        return self.head_dim + SCALE_BYTES if self.scaled else self.head_dim

    @property
    def row_bytes(self) -> int:
        return self.row * torch.empty((), dtype=self.dtype).element_size()


def kv_format(name: str, compute_dtype: torch.dtype, head_dim: int) -> KVFormat:
    """The format `--kv-cache-dtype name` gives (auto: the compute dtype's)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {name!r}")
    dtype = compute_dtype if name == "auto" else _STORAGE[name]
    if is_scaled(dtype) and head_dim % SCALE_BYTES:
        raise ValueError(f"kv_cache_dtype={name} needs a head size that is a multiple of "
                         f"{SCALE_BYTES}, this model's is {head_dim}")
    label = "fp8_e4m3" if dtype == _FP8 else str(dtype).removeprefix("torch.")
    return KVFormat(label, dtype, head_dim)


def is_scaled(dtype: torch.dtype) -> bool:
    """Whether rows of this cache dtype carry codes and a scale."""
    return dtype in _LARGEST


def _scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scale at the end of each scaled row: [..., 1], a view."""
    d = rows.shape[-1] - SCALE_BYTES
    return rows.view(torch.uint8).view(torch.float32)[..., d // 4:]


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows x [..., D] as stored in a cache of `dtype`: [..., D + 4] codes and scale for a
    scaled dtype, x in `dtype` otherwise."""
    if not is_scaled(dtype):
        return x.to(dtype)
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / _LARGEST[dtype]
    # A subnormal scale divides x past the largest code: such a row (every value below
    # ~1e-36) is stored as zeros, as the C++ writer (csrc/kv_rows.h) stores it.
    scale = torch.where(scale < torch.finfo(torch.float32).tiny, torch.zeros_like(scale), scale)
    codes = x / torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = codes.round().to(dtype) if dtype == torch.int8 else codes.to(dtype)
    rows = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=dtype, device=x.device)
    rows[..., :x.shape[-1]] = codes
    _scales(rows).copy_(scale)
    return rows


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Cache rows back as values [..., D] in `dtype` (the inverse of `quantize_rows`)."""
    if not is_scaled(rows.dtype):
        return rows.to(dtype)
    d = rows.shape[-1] - SCALE_BYTES
    return (rows[..., :d].float() * _scales(rows)).to(dtype)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Store rows x [T, KVH, D] at `slots` of a cache [NB, BS, KVH, row]."""
    flat = cache.view(-1, *cache.shape[2:])
    rows = quantize_rows(x, cache.dtype)
    if is_scaled(cache.dtype):  # index_copy_ has no float8 kernel: move the bytes
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows)
