"""AWQ with integer activations (`awq_activations=int16 | int8`, csrc/awq_int16_cpu.cpp and
csrc/awq_int8_cpu.cpp): each kernel against a float64 reference within the error its
quantization of x allows, under every flavour that has it; where it runs (the GEMV's rows
only); and the engine setting's checks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pkv.core.config.engine import EngineConfig
from pkv.core.engine.llm_engine import LLMEngine
from pkv.core.layers.int4_tiles import gemv_rows
from pkv.csrc import cpp_build
from pkv.plugins.weights import awq
from pkv.plugins.weights.awq import AWQLinearMethod
from pkv.quantize.pipeline import QuantizeReport
from tests.quantization.test_batched_kernels import AWQ_SHAPES, _awq_layer

FLAVOURS = cpp_build.runnable_flavours()
# The flavours with vpmaddwd / vpmaddubsw; the generic one (SSE2 / NEON builds) has neither.
INTEGER_FLAVOURS = [f for f in FLAVOURS if f != "generic"]
# Per kind: the grid's largest code and the inputs sharing one scale (None: the AWQ group).
GRIDS = {"int16": (32767, None), "int8": (127, 32)}


@pytest.fixture(scope="module", params=[(f, a) for f in INTEGER_FLAVOURS for a in GRIDS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def kernel(request: pytest.FixtureRequest):  # noqa: ANN201 - (module, activations, GEMV)
    flavour, activations = request.param
    ext = cpp_build.kernels(flavour)
    assert ext.awq_gemv_has_integer()
    return ext, activations, getattr(ext, f"awq_gemv_{activations}")


def _bound(x: torch.Tensor, w: torch.Tensor, group: int, activations: str) -> torch.Tensor:
    """|error| allowed per output: each x_k is off by at most half a step of its block's
    grid (max |x| over the block / the largest code), times |W[k, n]|; plus float32
    rounding."""
    top, block = GRIDS[activations]
    block = block or group
    rows, k = x.shape
    step = x.abs().reshape(rows, k // block, block).amax(-1) / top
    per_input = (step / 2).repeat_interleave(block, dim=1).double()
    return per_input @ w.abs() + 1e-5 * (x.double().abs() @ w.abs())


@pytest.mark.parametrize("k,n,group", AWQ_SHAPES)  # groups of whole 32-input blocks (int8)
def test_gemv_is_within_its_quantization_error(kernel, k: int, n: int, group: int) -> None:  # noqa: ANN001
    ext, activations, gemv = kernel
    layer, w = _awq_layer(k, n, group, bias=False, seed=k * n)
    args = (layer.codes, layer.scales_f32, layer.zs, n, group)
    gen = torch.Generator().manual_seed(k)
    # Every remainder of the kernel's 8-row chunks, and more rows than the engine gives it.
    for rows in [*range(1, 11), ext.awq_gemv_max_rows + 1]:
        x = torch.randn(rows, k, generator=gen)
        x[:, 5] *= 40  # an outlier coarsens its block's grid, and only its block's
        ref = x.double() @ w
        y = gemv(x, *args)
        assert y.shape == (rows, n)
        err = (y.double() - ref).abs()
        assert (err <= _bound(x, w, group, activations)).all(), f"{rows} rows: worst {err.max():.3g}"
        assert not torch.equal(y, ext.awq_gemv(x, *args))  # quantized, not the float path


def _quantized(x: torch.Tensor, block: int, top: int) -> torch.Tensor:
    """x as the kernel rounds it: per block, codes round(x * top / max |x|) (half to even)
    times max |x| / top, in float32 as the kernel computes them."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // block, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / top)).reshape(rows, k)


@pytest.mark.parametrize("k,n,group", AWQ_SHAPES)
def test_gemv_is_the_dot_product_of_its_quantized_x(kernel, k: int, n: int, group: int) -> None:  # noqa: ANN001
    # The zero term takes the quantized x's sum too, so that x's rounding meets the weights
    # (centred on zero), not the bare codes (0..15): against the quantized x the result is
    # exact up to float32 summation (a float sum of x is off from it by zs times the sum of
    # x's rounding, far outside this bound).
    ext, activations, gemv = kernel
    top, block = GRIDS[activations]
    layer, w = _awq_layer(k, n, group, bias=False, seed=k + n)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(n))
    x[:, 3] *= 40
    xq = _quantized(x, block or group, top).double()
    y = gemv(x, layer.codes, layer.scales_f32, layer.zs, n, group).double()
    assert ((y - xq @ w).abs() <= 2e-6 * (xq.abs() @ w.abs()) + 1e-6).all()


def test_a_non_finite_activation_makes_its_row_nan(kernel) -> None:  # noqa: ANN001
    _, _, gemv = kernel
    layer, _ = _awq_layer(128, 40, 32, bias=False, seed=3)
    x = torch.randn(3, 128)
    x[1, 70] = float("nan")
    x[2, 3] = float("inf")
    y = gemv(x, layer.codes, layer.scales_f32, layer.zs, 40, 32)
    assert torch.isfinite(y[0]).all() and y[1:].isnan().all()


def test_awq_linear_uses_the_integer_gemv_for_its_rows_only(kernel) -> None:  # noqa: ANN001
    ext, activations, gemv = kernel
    k, n, group = 320, 72, 64
    layer, _ = _awq_layer(k, n, group, bias=False, seed=7)
    args = (layer.codes, layer.scales_f32, layer.zs)
    bits = awq.ACTIVATION_BITS[activations]
    limit = ext.awq_gemv_max_rows
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, k)
        y = ext.awq_linear(x, *args, None, n, group, limit, bits)
        expected = (gemv(x, *args, n, group) if rows <= limit
                    else ext.awq_gemm(x, *args, n, group))
        assert torch.equal(y, expected), rows
    with pytest.raises(RuntimeError, match="activation_bits must be 32, 16 or 8"):
        ext.awq_linear(x, *args, None, n, group, limit, 4)


@pytest.mark.parametrize("flavour", INTEGER_FLAVOURS)
def test_int8_layers_keep_the_int8_gemv_up_to_its_own_limit(flavour: str) -> None:
    """The layer's rows go to the int8 GEMV up to `awq_int8_max_rows` (AVX2: any number, its
    GEMV ahead of the float GEMM at every count measured; AVX-512: the float limit), the float
    GEMM above."""
    ext = cpp_build.kernels(flavour)
    limit = gemv_rows(ext, 8)
    assert gemv_rows(ext, 32) == gemv_rows(ext, 16) == ext.awq_gemv_max_rows
    assert limit == (ext.awq_gemv_max_rows if flavour == "avx512" else sys.maxsize)
    k, n, group = 320, 72, 32
    layer, _ = _awq_layer(k, n, group, bias=False, seed=11)
    args = (layer.codes, layer.scales_f32, layer.zs, n, group)
    for rows in (ext.awq_gemv_max_rows + 1, 100):
        x = torch.randn(rows, k)
        y = ext.awq_linear(x, *args[:3], None, n, group, limit, 8)
        expected = ext.awq_gemv_int8(x, *args) if rows <= limit else ext.awq_gemm(x, *args)
        assert torch.equal(y, expected), rows


def test_the_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="awq_activations must be one of float32, int16, int8"):
        EngineConfig(awq_activations="int4")
    for activations in ("int16", "int8"):
        with pytest.raises(ValueError, match="needs the avx2 or avx512 CPU kernels"):
            AWQLinearMethod(64, "triton").set_activations(activations)
    with pytest.raises(ValueError, match="groups of a multiple of 8 inputs up to 2048"):
        AWQLinearMethod(4096, "cpu").set_activations("int16")
    with pytest.raises(ValueError, match="groups of a multiple of 32 inputs; this checkpoint's "
                                         "are 48"):
        AWQLinearMethod(48, "cpu").set_activations("int8")
    method = AWQLinearMethod(128, "cpu")
    method.set_activations("int8")
    assert method.activation_bits == 8


@pytest.mark.parametrize("activations", GRIDS)
def test_the_generic_flavour_refuses_integer_activations(
        activations: str, monkeypatch: pytest.MonkeyPatch) -> None:
    generic = cpp_build.kernels("generic")
    assert not generic.awq_gemv_has_integer()
    layer, _ = _awq_layer(64, 40, 32, bias=False, seed=1)
    with pytest.raises(RuntimeError, match=f"no {activations} AWQ GEMV"):
        getattr(generic, f"awq_gemv_{activations}")(torch.randn(1, 64), layer.codes,
                                                     layer.scales_f32, layer.zs, 40, 32)
    monkeypatch.setenv("PKV_CPU_ISA", "generic")
    with pytest.raises(ValueError, match="this model runs the generic"):
        AWQLinearMethod(64, "cpu").set_activations(activations)


def test_a_float_model_refuses_integer_activations(tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="8MiB",
                          awq_activations="int8")
    with pytest.raises(ValueError, match="needs an AWQ checkpoint; this model's linear layers "
                                         "are float"):
        LLMEngine(config, show_progress=False)


@pytest.mark.skipif("avx2" not in FLAVOURS, reason="no AVX2 on this CPU")
def test_engine_hidden_states_stay_close_to_float32(awq_tiny: tuple[Path, QuantizeReport]):
    from tests.quantization.test_fused_decoder import _one_sequence_meta

    hidden = {}
    for activations in ("float32", *GRIDS):
        engine = LLMEngine(EngineConfig(model=str(awq_tiny[0]), kv_cache_memory="8MiB",
                                        max_model_len=64, awq_activations=activations),
                           show_progress=False)
        runner = engine.runner
        tokens = torch.arange(3, 9)  # 6 rows: the GEMV
        meta = _one_sequence_meta(len(tokens), runner.block_size)
        with torch.inference_mode():
            hidden[activations] = runner.model.model(tokens, torch.arange(len(tokens)),
                                                     runner.kv_caches, meta)
    # int16 keeps ~2^-16 of a group's largest activation, int8 ~2^-8 of a 32-input block's:
    # the hidden states' relative error (this random model: ~2e-4 and ~3e-2).
    error = {a: ((hidden[a] - hidden["float32"]).norm() / hidden["float32"].norm()).item()
             for a in GRIDS}
    assert 0 < error["int16"] < 1e-3 and error["int16"] < error["int8"] < 6e-2, error
