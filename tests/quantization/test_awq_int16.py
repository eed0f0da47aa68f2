"""AWQ with int16 activations (`awq_activations=int16`, csrc/awq_int16_cpu.cpp): the kernel
against a float64 reference within the error its quantization of x allows, under every flavour
that has it; where it runs (the GEMV's rows only); and the engine setting's checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pkv.core.config import EngineConfig
from pkv.core.llm_engine import LLMEngine
from pkv.plugins import cpp_build
from pkv.plugins.weights import awq
from pkv.plugins.weights.awq import AWQLinearMethod
from pkv.quantize.pipeline import QuantizeReport
from tests.quantization.test_batched_kernels import AWQ_SHAPES, _awq_layer

FLAVOURS = cpp_build.runnable_flavours()
# The flavours with vpmaddwd; the generic one (SSE2 / NEON builds) has no int16 GEMV.
INT16_FLAVOURS = [f for f in FLAVOURS if f != "generic"]


@pytest.fixture(scope="module", params=INT16_FLAVOURS)
def ext(request: pytest.FixtureRequest):  # noqa: ANN201 - the compiled module
    ext = cpp_build.kernels(request.param)
    assert ext.awq_gemv_has_int16()
    return ext


def _bound(x: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """|error| allowed per output: each x_k is off by at most half a step of its group's
    int16 grid (max |x| / 32767), times |W[k, n]|; plus float32 rounding."""
    rows, k = x.shape
    step = x.abs().reshape(rows, k // group, group).amax(-1) / 32767
    per_input = (step / 2).repeat_interleave(group, dim=1).double()
    return per_input @ w.abs() + 1e-5 * (x.double().abs() @ w.abs())


@pytest.mark.parametrize("k,n,group", AWQ_SHAPES)
def test_int16_gemv_is_within_its_quantization_error(ext, k: int, n: int, group: int) -> None:  # noqa: ANN001
    layer, w = _awq_layer(k, n, group, bias=False, seed=k * n)
    args = (layer.codes, layer.scales_f32, layer.zs, n, group)
    gen = torch.Generator().manual_seed(k)
    for rows in range(1, awq.GEMV_MAX_ROWS + 3):
        x = torch.randn(rows, k, generator=gen)
        x[:, 5] *= 40  # an outlier coarsens its group's grid, and only its group's
        ref = x.double() @ w
        y = ext.awq_gemv_int16(x, *args)
        assert y.shape == (rows, n)
        err = (y.double() - ref).abs()
        assert (err <= _bound(x, w, group)).all(), f"{rows} rows: worst {err.max():.3g}"
        assert not torch.equal(y, ext.awq_gemv(x, *args))  # quantized, not the float path


def test_a_non_finite_activation_makes_its_row_nan(ext) -> None:  # noqa: ANN001
    layer, _ = _awq_layer(128, 40, 32, bias=False, seed=3)
    x = torch.randn(3, 128)
    x[1, 70] = float("nan")
    x[2, 3] = float("inf")
    y = ext.awq_gemv_int16(x, layer.codes, layer.scales_f32, layer.zs, 40, 32)
    assert torch.isfinite(y[0]).all() and y[1:].isnan().all()


def test_awq_linear_uses_int16_for_the_gemv_rows_only(ext) -> None:  # noqa: ANN001
    k, n, group = 320, 72, 64
    layer, _ = _awq_layer(k, n, group, bias=False, seed=7)
    args = (layer.codes, layer.scales_f32, layer.zs)
    for rows in (1, awq.GEMV_MAX_ROWS, awq.GEMV_MAX_ROWS + 1):
        x = torch.randn(rows, k)
        y = ext.awq_linear(x, *args, None, n, group, awq.GEMV_MAX_ROWS, True)
        expected = (ext.awq_gemv_int16(x, *args, n, group) if rows <= awq.GEMV_MAX_ROWS
                    else ext.awq_gemm(x, *args, n, group))
        assert torch.equal(y, expected), rows


def test_the_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="awq_activations must be one of float32, int16"):
        EngineConfig(awq_activations="int8")
    method = AWQLinearMethod(64, "triton")
    with pytest.raises(ValueError, match="needs the avx2 or avx512 CPU kernels"):
        method.set_activations("int16")
    with pytest.raises(ValueError, match="groups of a multiple of 8 inputs up to 2048"):
        AWQLinearMethod(4096, "cpu").set_activations("int16")


def test_the_generic_flavour_refuses_int16(monkeypatch: pytest.MonkeyPatch) -> None:
    generic = cpp_build.kernels("generic")
    assert not generic.awq_gemv_has_int16()
    layer, _ = _awq_layer(64, 40, 32, bias=False, seed=1)
    with pytest.raises(RuntimeError, match="no int16 AWQ GEMV"):
        generic.awq_gemv_int16(torch.randn(1, 64), layer.codes, layer.scales_f32, layer.zs, 40, 32)
    monkeypatch.setenv("PKV_CPU_ISA", "generic")
    with pytest.raises(ValueError, match="this model runs the generic"):
        AWQLinearMethod(64, "cpu").set_activations("int16")


def test_a_float_model_refuses_int16(tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="8MiB",
                          awq_activations="int16")
    with pytest.raises(ValueError, match="needs an AWQ checkpoint; this model's linear layers "
                                         "are float"):
        LLMEngine(config, show_progress=False)


@pytest.mark.skipif("avx2" not in FLAVOURS, reason="no AVX2 on this CPU")
def test_engine_hidden_states_stay_close_to_float32(awq_tiny: tuple[Path, QuantizeReport]):
    from tests.quantization.test_fused_decoder import _one_sequence_meta

    hidden = {}
    for activations in ("float32", "int16"):
        engine = LLMEngine(EngineConfig(model=str(awq_tiny[0]), kv_cache_memory="8MiB",
                                        max_model_len=64, awq_activations=activations),
                           show_progress=False)
        runner = engine.runner
        tokens = torch.arange(3, 9)  # 6 rows: the GEMV
        meta = _one_sequence_meta(len(tokens), runner.block_size)
        with torch.inference_mode():
            hidden[activations] = runner.model.model(tokens, torch.arange(len(tokens)),
                                                     runner.kv_caches, meta)
    assert not torch.equal(hidden["int16"], hidden["float32"])
    torch.testing.assert_close(hidden["int16"], hidden["float32"], rtol=2e-3, atol=2e-3)
