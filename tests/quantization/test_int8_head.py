"""The int8 LM head of 4-bit models: quantization, the C++ GEMV against a float64 reference,
the torch fallback, and when the engine chooses it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pkv.core.config.engine import EngineConfig
from pkv.core.engine.llm import LLM
from pkv.core.layers.int8_linear import Int8LinearMethod, quantize_rows, tile_codes
from pkv.core.layers.linear import Linear
from pkv.core.model_loader.quantization import int8_lm_head
from pkv.core.registry import discover
from pkv.core.sample.sampling_params import SamplingParams


def _int8_layer(k: int, n: int, seed: int = 0) -> tuple[Linear, torch.Tensor]:
    torch.manual_seed(seed)
    layer = Linear(k, [n], False)
    weight = torch.randn(n, k) * torch.rand(n, 1) * 3  # per-row ranges differ
    Int8LinearMethod.convert(layer, weight)
    return layer, weight


def test_row_quantization_error_is_half_a_step():
    w = torch.randn(50, 70) * torch.rand(50, 1)
    codes, scale = quantize_rows(w)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    assert ((codes.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    assert torch.equal(quantize_rows(torch.zeros(2, 4))[0], torch.zeros(2, 4, dtype=torch.int8))


def test_tiles_pad_outputs_to_32():
    codes = torch.arange(40 * 3, dtype=torch.int8).reshape(40, 3)
    tiles = tile_codes(codes)
    assert tiles.shape == (2, 3, 32)
    assert tiles[1, 2, 7] == codes[39, 2] and (tiles[1, :, 8:] == 0).all()


# 17 and 129 rows: past the generic and the AVX kernels' GEMV limits (int8_gemv_max_rows).
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, 70, 129])
@pytest.mark.parametrize("k,n", [(64, 96), (96, 40), (33, 64)])  # 33: an odd last input
def test_kernel_matches_float64_reference(rows: int, k: int, n: int):
    layer, weight = _int8_layer(k, n, rows)
    assert layer.kernel is not None, "the int8 kernel did not build"
    codes, scale = quantize_rows(weight)
    x = torch.randn(rows, k)
    ref = x.double() @ (codes.double() * scale.double()[:, None]).t()
    with torch.inference_mode():
        y = layer(x)
    assert y.shape == (rows, n)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
    layer.kernel = None  # the torch path (no compiler) computes the same
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-4)


def test_the_layer_takes_the_gemv_up_to_the_kernels_row_limit():
    layer, _ = _int8_layer(576, 200)
    limit = layer.kernel.int8_gemv_max_rows
    gemv, gemm = layer.kernel.int8_gemv, layer.kernel.int8_gemm
    for rows, taken, other in ((limit, gemv, gemm), (limit + 1, gemm, gemv)):
        x = torch.randn(rows, 576)
        with torch.inference_mode():
            y = layer(x)
        assert torch.equal(y, taken(x, layer.codes, layer.scale)[:, :200]), rows
        assert not torch.equal(y, other(x, layer.codes, layer.scale)[:, :200]), rows


def test_engine_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    awq = discover().weight_loaders["awq"].load()()
    assert int8_lm_head("auto", awq, cpu) and not int8_lm_head("auto", None, cpu)
    assert not int8_lm_head("auto", awq, cuda) and not int8_lm_head("none", awq, cpu)
    assert int8_lm_head("int8", None, cpu)
    with pytest.raises(ValueError, match="lm_head_quantization=int8 is a CPU kernel"):
        int8_lm_head("int8", None, cuda)
    with pytest.raises(ValueError, match="lm_head_quantization must be one of auto, none, int8"):
        EngineConfig(lm_head_quantization="int4")


def test_awq_model_serves_with_an_int8_head_close_to_float(awq_tiny: tuple[Path, object]):
    path, _ = awq_tiny
    prompts = [[5, 17, 300, 42, 9], [7, 7, 7, 1000]]
    outs = {}
    for head in ("auto", "none"):
        llm = LLM(model=str(path), kv_cache_memory="4MiB", lm_head_quantization=head)
        head_method = llm.llm_engine.runner.model.lm_head.method.name
        assert head_method == ("int8" if head == "auto" else "float")
        outs[head] = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, logprobs=1))
    for a, b in zip(outs["auto"], outs["none"]):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        token = a.outputs[0].token_ids[0]
        assert abs(first_a[token].logprob - first_b[token].logprob) < 0.05
