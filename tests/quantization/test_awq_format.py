"""AutoAWQ GEMM packing and the CPU AWQ linear (fused kernel and torch fallback)."""

from __future__ import annotations

import pytest
import torch

from pkv.core.layers.linear import Linear
from pkv.plugins.weights.awq import AWQLinearMethod, dequantize, pack_int4, unpack_int4


def _reference_pack(codes: list[list[int]]) -> list[list[int]]:
    """Pack with Python ints, straight from the format's description: nibble i of int32 c
    holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; values are two's-complement int32."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    out = []
    for row in codes:
        packed_row = []
        for c in range(len(row) // 8):
            word = sum(row[8 * c + order[i]] << (4 * i) for i in range(8))
            packed_row.append(word - 2**32 if word >= 2**31 else word)
        out.append(packed_row)
    return out


def test_pack_matches_the_described_bit_order() -> None:
    # Column j holds value j: nibble i must then hold order[i].
    codes = torch.arange(8).repeat(2, 1)
    assert pack_int4(codes).tolist() == [[0x75316420], [0x75316420]]


@pytest.mark.parametrize("shape", [(1, 8), (3, 16), (7, 64)])
def test_pack_unpack_round_trip_against_reference(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    codes = torch.randint(0, 16, shape, generator=gen)
    packed = pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (shape[0], shape[1] // 8)
    assert packed.tolist() == _reference_pack(codes.tolist())
    assert torch.equal(unpack_int4(packed).long(), codes)


def test_high_nibble_15_gives_negative_int32() -> None:
    codes = torch.full((1, 8), 15)
    assert pack_int4(codes).item() == -1
    assert unpack_int4(torch.tensor([[-1]], dtype=torch.int32)).tolist() == [[15] * 8]


def _random_awq(k: int, n: int, group: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    qweight = pack_int4(torch.randint(0, 16, (k, n), generator=gen))
    qzeros = pack_int4(torch.randint(0, 16, (k // group, n), generator=gen))
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).half()
    return qweight, qzeros, scales


def test_dequantize_follows_the_formula() -> None:
    qweight, qzeros, scales = _random_awq(64, 16, 32)
    w = dequantize(qweight, qzeros, scales, 32)
    q, z = unpack_int4(qweight).float(), unpack_int4(qzeros).float()
    for k, n in [(0, 0), (31, 7), (32, 8), (63, 15)]:
        expected = (q[k, n] - z[k // 32, n]) * scales[k // 32, n].float()
        assert w[k, n].item() == pytest.approx(expected.item())


def _awq_linear(k: int, out_sizes: list[int], group: int, kernel: bool,
                triton: bool = False) -> tuple[Linear, torch.Tensor]:
    method = AWQLinearMethod(group, "triton" if triton else "cpu" if kernel else "torch")
    layer = Linear(k, out_sizes, bias=True, method=method)
    qweight, qzeros, scales = _random_awq(k, sum(out_sizes), group, seed=k)
    with torch.no_grad():
        for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales),
                        ("bias", torch.randn(sum(out_sizes)))):
            layer.load(name, t, None, name)
        method.process_weights_after_loading(layer)
    reference = dequantize(qweight, qzeros, scales, group).t()  # [N, K]
    return layer, reference


@pytest.mark.parametrize("kernel", [True, False], ids=["csrc-kernel", "torch-fallback"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40, 70])
def test_awq_linear_matches_dequantized_matmul(kernel: bool, rows: int) -> None:
    layer, w = _awq_linear(128, [24, 40], 32, kernel)
    assert kernel == (layer.kernel is not None)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ w.double().t() + layer.bias.double()
    got = layer(x)
    assert got.shape == (rows, 64)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 5, 70])
def test_awq_kernel_pads_columns_to_its_tiles(rows: int) -> None:
    # 72 outputs: two whole tiles of 32 and one of 8, padded.
    layer, w = _awq_linear(64, [24, 16, 8, 24], 32, kernel=True)
    assert layer.kernel is not None and layer.codes.shape == (3, 8, 32)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ w.double().t() + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-4, atol=1e-4)


def test_awq_group_size_the_kernel_cannot_take_falls_back_to_torch() -> None:
    layer, w = _awq_linear(48, [16], 6, kernel=True)
    assert layer.kernel is None and layer.weight_t.shape == (48, 16)
    x = torch.randn(3, 48)
    torch.testing.assert_close(layer(x), x @ w.t() + layer.bias, rtol=1e-4, atol=1e-4)


def test_awq_linear_through_the_triton_kernel() -> None:
    """The GPU path's glue (checkpoint layout kept, bias, shapes), run by the interpreter."""
    pytest.importorskip("triton")
    layer, w = _awq_linear(64, [16, 16], 32, kernel=False, triton=True)
    assert layer.qweight.dtype == torch.int32  # not repacked
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ w.t() + layer.bias, rtol=1e-4, atol=1e-4)


def test_awq_linear_keeps_leading_dims_and_dtype() -> None:
    layer, w = _awq_linear(64, [16], 64, kernel=True)
    x = torch.randn(2, 5, 64).bfloat16()
    got = layer(x)
    assert got.shape == (2, 5, 16) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), (x.float() @ w.t() + layer.bias).float(),
                               rtol=2e-2, atol=2e-2)


def test_awq_shapes_are_checked_when_building_and_loading() -> None:
    with pytest.raises(ValueError, match="group size 48 does not divide .* 64"):
        Linear(64, [16], False, AWQLinearMethod(48))
    with pytest.raises(ValueError, match="divisible by 8"):
        Linear(64, [12], False, AWQLinearMethod(32))
    layer = Linear(64, [16], False, AWQLinearMethod(32))
    with pytest.raises(ValueError, match="'m.qzeros' has shape \\(4, 2\\), the model expects "
                                         "\\(2, 2\\)"):
        layer.load("qzeros", torch.zeros(4, 2, dtype=torch.int32), None, "m.qzeros")
    with pytest.raises(ValueError, match="'m.weight' has no place"):
        layer.load("weight", torch.zeros(16, 64), None, "m.weight")
