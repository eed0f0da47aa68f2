"""The AWQ GEMM Triton kernel against a float64 reference that unpacks the AutoAWQ layout itself.

On CPU the kernel runs under TRITON_INTERPRET=1 (set by tests/conftest.py), so shapes stay small.
"""

from __future__ import annotations

import pytest
import torch

from pkv.plugins.weights.awq_triton import awq_gemm_triton

# Nibble i of a packed int32 holds column 8c + AWQ_ORDER[i].
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, N/8] int32 -> [R, N] int64 in 0..15, one nibble at a time in AutoAWQ order."""
    rows, cols = packed.shape
    out = torch.empty(rows, cols * 8, dtype=torch.int64)
    wide = packed.cpu().to(torch.int64) & 0xFFFFFFFF  # two's complement bits, no sign
    for nibble, j in enumerate(AWQ_ORDER):
        out[:, j::8] = (wide >> (4 * nibble)) & 0xF
    return out


def _pack(values: torch.Tensor) -> torch.Tensor:
    """[R, N] ints in 0..15 -> [R, N/8] int32, the inverse of _unpack."""
    wide = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for nibble, j in enumerate(AWQ_ORDER):
        wide |= values[:, j::8].to(torch.int64) << (4 * nibble)
    return torch.where(wide >= 2**31, wide - 2**32, wide).to(torch.int32)


def _reference(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
               scales: torch.Tensor, group_size: int) -> torch.Tensor:
    q = _unpack(qweight)  # [K, N]
    z = _unpack(qzeros).repeat_interleave(group_size, dim=0)  # [K, N]
    s = scales.cpu().double().repeat_interleave(group_size, dim=0)
    return x.cpu().double() @ ((q - z).double() * s)


def _random_awq(m: int, k: int, n: int, group_size: int, x_dtype: torch.dtype,
                scale_dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    qweight = torch.randint(-2**31, 2**31, (k, n // 8), generator=gen, dtype=torch.int64)
    qweight = qweight.to(torch.int32)
    zeros = torch.randint(0, 16, (k // group_size, n), generator=gen)
    scales = (torch.rand(k // group_size, n, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    tensors = (x, qweight, _pack(zeros), scales)
    return tuple(t.to(device) for t in tensors)


def test_pack_round_trip_matches_stated_order():
    # Column 8c+j lives in nibble [0,4,1,5,2,6,3,7][j]: column 1 is nibble 4 (bits 16..19).
    values = torch.zeros(1, 8, dtype=torch.int64)
    values[0, 1] = 0xA
    assert _pack(values).item() == 0xA << 16
    values = torch.randint(0, 16, (3, 32))
    assert torch.equal(_unpack(_pack(values)), values)


@pytest.mark.parametrize("m,k,n,group_size", [
    (1, 64, 16, 32),     # decode: one token
    (5, 128, 72, 64),    # M and N not multiples of the block
    (17, 64, 8, 32),     # M just past a block of 16, a single packed column
    (33, 192, 136, 64),  # several K groups, two N blocks
])
def test_float32_matches_reference(device: str, m: int, k: int, n: int, group_size: int):
    x, qweight, qzeros, scales = _random_awq(m, k, n, group_size, torch.float32, torch.float16,
                                             device, seed=m * 1000 + n)
    out = awq_gemm_triton(x, qweight, qzeros, scales, group_size)
    assert out.shape == (m, n) and out.dtype == torch.float32
    expected = _reference(x, qweight, qzeros, scales, group_size)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-4, atol=1e-4)


def test_float16_matches_reference(device: str):
    x, qweight, qzeros, scales = _random_awq(3, 128, 40, 32, torch.float16, torch.float16,
                                             device, seed=7)
    out = awq_gemm_triton(x, qweight, qzeros, scales, 32)
    assert out.dtype == torch.float16
    expected = _reference(x, qweight, qzeros, scales, 32)
    # W is rounded to float16 before the float32-accumulated dot, as on tensor cores.
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-2, atol=2e-2)


def test_float32_scales(device: str):
    x, qweight, qzeros, scales = _random_awq(2, 64, 24, 64, torch.float32, torch.float32,
                                             device, seed=3)
    out = awq_gemm_triton(x, qweight, qzeros, scales, 64)
    expected = _reference(x, qweight, qzeros, scales, 64)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-4, atol=1e-4)


def test_bad_shapes_name_the_tensor(device: str):
    x, qweight, qzeros, scales = _random_awq(2, 64, 16, 32, torch.float32, torch.float16,
                                             device, seed=0)
    with pytest.raises(ValueError, match="group_size"):
        awq_gemm_triton(x, qweight, qzeros, scales, 48)  # does not divide K=64
    with pytest.raises(ValueError, match="x must"):
        awq_gemm_triton(x.long(), qweight, qzeros, scales, 32)
    with pytest.raises(ValueError, match="qweight"):
        awq_gemm_triton(x, qweight[:32], qzeros, scales, 32)  # K mismatch
    with pytest.raises(ValueError, match="qweight"):
        awq_gemm_triton(x, qweight.float(), qzeros, scales, 32)
    with pytest.raises(ValueError, match="qzeros"):
        awq_gemm_triton(x, qweight, qzeros[:1], scales, 32)
    with pytest.raises(ValueError, match="scales.*multiple of 8"):
        awq_gemm_triton(x, qweight, qzeros, scales[:, :12], 32)  # N=12
    with pytest.raises(ValueError, match="qweight"):
        awq_gemm_triton(x, qweight, qzeros, scales[:, :8], 32)  # N=8 but qweight packs 16
    with pytest.raises(ValueError, match="scales must have"):
        awq_gemm_triton(x, qweight, qzeros, scales[:1], 32)
    with pytest.raises(ValueError, match="scales"):
        awq_gemm_triton(x, qweight, qzeros, scales.to(torch.int32), 32)
