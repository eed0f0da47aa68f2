"""FP8's torch._scaled_mm path (runs on CPU too) and the optional AutoAWQ delegate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pkv.core.layers.linear import Linear
from pkv.plugins.weights.fp8 import FP8LinearMethod, quantize_per_channel


def _fp8_linear(scaled_mm: bool, weight: torch.Tensor) -> Linear:
    method = FP8LinearMethod(scaled_mm)
    layer = Linear(weight.shape[1], [weight.shape[0]], False, method)
    q, scale = quantize_per_channel(weight)
    with torch.no_grad():
        layer.load("weight", q, None, "weight")
        layer.load("weight_scale", scale, None, "weight_scale")
    method.process_weights_after_loading(layer)
    return layer


def _in_bfloat16(scaled_mm: bool, weight: torch.Tensor) -> Linear:
    # Models are built under their compute dtype (bfloat16 on a GPU by default)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return _fp8_linear(scaled_mm, weight)
    finally:
        torch.set_default_dtype(default)


def test_scaled_mm_matches_dequantized_fp8() -> None:
    # The scales stay float32 (the only kind _scaled_mm takes); bfloat16 out
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(48, 64, generator=gen), torch.randn(5, 64, generator=gen)
    native = _in_bfloat16(True, weight)
    assert native.weight.dtype == torch.float8_e4m3fn
    assert native.weight_scale.dtype == torch.float32
    y = native(x.bfloat16())
    assert y.dtype == torch.bfloat16
    dense = _fp8_linear(False, weight)
    assert dense.weight.dtype == torch.float32
    expected = dense(x)
    torch.testing.assert_close(y.float(), expected, rtol=0.08, atol=0.3)
    # Both stay close to the float layer: FP8 keeps ~2 significant digits.
    assert (expected - x @ weight.t()).abs().max() < 0.05 * (x @ weight.t()).abs().max()


def test_layers_scaled_mm_would_refuse_are_dequantized_once() -> None:
    # Row-wise _scaled_mm: bfloat16 out only on some torch versions' GPUs, and sizes in
    # multiples of 16 (an uneven tensor-parallel split is not)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 64, generator=gen)
    for layer in (_fp8_linear(True, torch.randn(48, 64, generator=gen)),  # float32 out
                  _in_bfloat16(True, torch.randn(40, 64, generator=gen))):  # 40 rows
        assert layer.weight.dtype != torch.float8_e4m3fn and not layer.fp8_matmul
        assert layer(x.to(layer.weight.dtype)).shape == (3, layer.weight.shape[0])


def test_autoawq_output_loads_in_pkv(tmp_path: Path, tiny_llama_dir: Path) -> None:
    pytest.importorskip("awq", reason="autoawq is optional (pip install 'pkv[autoawq]')")
    from pkv.quantize.autoawq_backend import quantize_with_autoawq
    from pkv.quantize.pipeline import QuantizeOptions, load_quantized

    out = tmp_path / "autoawq"
    quantize_with_autoawq(QuantizeOptions(str(tiny_llama_dir), out, "awq", calib_samples=4,
                                          calib_seq_len=64))
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 4
    model = load_quantized(out, 64)
    assert model.model.layers[0].mlp.down_proj.method.name == "awq"
