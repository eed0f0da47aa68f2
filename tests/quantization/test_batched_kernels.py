"""The CPU kernels' every entry point (awq_gemv, awq_gemm, awq_linear, int8_gemv, int8_gemm)
against float64 references, under every ISA flavour this CPU runs: odd sizes, tiles padded past
N, several panels of inputs, group sizes 32/64/128, row counts across the GEMV / GEMM switch
and the micro-kernels' row blocks."""

from __future__ import annotations

import pytest
import torch

from pkv.core.layers import int8_linear as int8
from pkv.core.layers.int8_linear import Int8LinearMethod, quantize_rows
from pkv.core.layers.linear import Linear
from pkv.csrc import cpp_build
from pkv.plugins.weights.awq import AWQLinearMethod, dequantize, pack_int4

FLAVOURS = cpp_build.runnable_flavours()
ROWS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 33, 64, 70]
# (K, N, group): one padded tile; two panels of inputs (256 + 64) with a padded tile; groups
# of 128 across a panel's edge (K = 384: 256 + 128), N a whole number of tiles.
AWQ_SHAPES = [(64, 40, 32), (320, 72, 64), (384, 64, 128), (288, 24, 32)]


@pytest.fixture(scope="module", params=FLAVOURS)
def ext(request: pytest.FixtureRequest):  # noqa: ANN201 - the compiled module
    try:
        return cpp_build.kernels(request.param)
    except RuntimeError as exc:  # no compiler or ninja: the torch paths serve instead
        pytest.skip(str(exc))


def _awq_layer(k: int, n: int, group: int, bias: bool, seed: int) -> tuple[Linear, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    method = AWQLinearMethod(group, "cpu")
    layer = Linear(k, [n], bias=bias, method=method)
    qweight = pack_int4(torch.randint(0, 16, (k, n), generator=gen))
    qzeros = pack_int4(torch.randint(0, 16, (k // group, n), generator=gen))
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).half()
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    if bias:
        tensors["bias"] = torch.randn(n, generator=gen)
    with torch.no_grad():
        for name, t in tensors.items():
            layer.load(name, t, None, name)
        method.process_weights_after_loading(layer)
    return layer, dequantize(qweight, qzeros, scales, group).double()  # [K, N]


@pytest.mark.parametrize("k,n,group", AWQ_SHAPES)
def test_awq_entry_points_match_float64(ext, k: int, n: int, group: int) -> None:  # noqa: ANN001
    layer, w = _awq_layer(k, n, group, bias=False, seed=k + n)
    gen = torch.Generator().manual_seed(n)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        ref = x.double() @ w
        args = (layer.codes, layer.scales_f32, layer.zs)
        for name, y in (("awq_gemv", ext.awq_gemv(x, *args, n, group)),
                        ("awq_gemm", ext.awq_gemm(x, *args, n, group)),
                        ("awq_linear/gemv", ext.awq_linear(x, *args, None, n, group, 1 << 20, 32)),
                        ("awq_linear/gemm", ext.awq_linear(x, *args, None, n, group, 0, 32))):
            assert y.shape == (rows, n), name
            torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{name}, {rows} rows: {m}")  # noqa: B023


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_layer_across_the_gemv_switch(ext, group: int, bias: bool) -> None:  # noqa: ANN001
    k, n = 256 + group, 104  # two panels of inputs; 104 outputs: three tiles and a padded one
    layer, w = _awq_layer(k, n, group, bias, seed=group)
    layer.kernel = ext
    b = layer.bias.double() if bias else 0
    limit = ext.awq_gemv_max_rows
    for rows in sorted({1, limit, limit + 1, 13, 70}):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        with torch.inference_mode():
            y = layer(x)
        torch.testing.assert_close(y.double(), x.double() @ w + b, rtol=1e-4, atol=1e-4)
    x = torch.randn(2, 9, k).bfloat16()  # leading dims and dtype kept, through the GEMM
    y = layer(x)
    assert y.shape == (2, 9, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), x.double() @ w + b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_awq_gemv_precision_on_hard_activations(ext, rows: int) -> None:  # noqa: ANN001
    """The GEMV reads codes as 16 + qH + qL/16 and cancels the bases out per group (see
    csrc/awq_cpu.cpp); with activations of one sign and a large offset, or rare outliers 300x
    the rest, the error must stay at float32 rounding of sum |x w| (measured <= 5e-6; the
    per-group constant off by 1e-4 of itself gives 2e-4), not only within the tolerance above."""
    k, n, group = 1536, 72, 64
    layer, w = _awq_layer(k, n, group, bias=False, seed=7)
    gen = torch.Generator().manual_seed(rows)
    base = torch.randn(rows, k, generator=gen)
    outliers = 1 + 300 * (torch.rand(rows, k, generator=gen) > 0.99)
    for name, x in (("offset", base + 20), ("outliers", base * outliers)):
        y = ext.awq_gemv(x, layer.codes, layer.scales_f32, layer.zs, n, group).double()
        bound = x.double().abs() @ w.abs()
        error = ((y - x.double() @ w).abs() / bound).max().item()
        assert error < 2e-5, f"{name}, {rows} rows: error {error:.1e} of sum |x w|"


# A GGUF's Q4_0 (w = d (q - 8)) is held without its zero terms: an empty zs stands for 8 x the
# scales, which every entry point derives as it goes, to the bit (8 x s is exact in float).
@pytest.mark.parametrize("k,n,group", [(64, 40, 32), (320, 72, 32)])
def test_an_empty_zs_is_eight_scales(ext, k: int, n: int, group: int) -> None:  # noqa: ANN001
    layer, _ = _awq_layer(k, n, group, bias=False, seed=k)
    codes, scales = layer.codes, layer.scales_f32
    given, empty = 8 * scales, torch.empty(0)
    torch.testing.assert_close(ext.awq_dequantize(codes, scales, empty, n, group),
                               ext.awq_dequantize(codes, scales, given, n, group), rtol=0, atol=0)
    bits = [32, 16, 8] if ext.awq_gemv_has_integer() else [32]
    gen = torch.Generator().manual_seed(n)
    for rows in (1, 3, 9, 40):
        x = torch.randn(rows, k, generator=gen)
        for b in bits:
            for limit in (0, 1 << 20):  # the GEMM, the GEMV of these bits
                want = ext.awq_linear(x, codes, scales, given, None, n, group, limit, b)
                got = ext.awq_linear(x, codes, scales, empty, None, n, group, limit, b)
                torch.testing.assert_close(got, want, rtol=0, atol=0,
                                           msg=lambda m: f"{b} bits, {rows} rows: {m}")  # noqa: B023
    with pytest.raises(RuntimeError, match="zs may be empty"):
        ext.awq_gemv(x, codes, scales, torch.zeros(3), n, group)


def test_awq_zero_rows(ext) -> None:  # noqa: ANN001
    layer, _ = _awq_layer(64, 40, 32, bias=False, seed=0)
    args = (layer.codes, layer.scales_f32, layer.zs, 40, 32)
    assert ext.awq_gemm(torch.zeros(0, 64), *args).shape == (0, 40)


@pytest.mark.parametrize("k,n", [(33, 40), (64, 96), (300, 72), (576, 64)])
def test_int8_entry_points_match_float64(ext, k: int, n: int) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(k * n)
    weight = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 3
    layer = Linear(k, [n], False)
    Int8LinearMethod.convert(layer, weight)
    layer.kernel = ext
    codes, scale = quantize_rows(weight)
    w = (codes.double() * scale.double()[:, None]).t()  # [K, N]
    padded = layer.codes.shape[0] * int8.TILE
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        ref = x.double() @ w
        for name, y in (("int8_gemv", ext.int8_gemv(x, layer.codes, layer.scale)),
                        ("int8_gemm", ext.int8_gemm(x, layer.codes, layer.scale))):
            assert y.shape == (rows, padded), name
            torch.testing.assert_close(y[:, :n].double(), ref, rtol=1e-5, atol=1e-4,
                                       msg=lambda m: f"{name}, {rows} rows: {m}")  # noqa: B023
            assert (y[:, n:] == 0).all(), name  # padded outputs have zero codes
        with torch.inference_mode():
            torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-4)
    assert ext.int8_gemm(torch.zeros(0, k), layer.codes, layer.scale).shape == (0, padded)
