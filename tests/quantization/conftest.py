"""Quantized copies of the tiny random models, made once per session by `pkv quantize`'s
pipeline (small calibration so the search stays fast)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkv.quantize.pipeline import QuantizeOptions, QuantizeReport, quantize_model

HELDOUT = Path(__file__).resolve().parents[2] / "quantize" / "data" / "heldout.txt"


def quantize_tiny(model: Path, out: Path, method: str, **kwargs) -> QuantizeReport:  # noqa: ANN003
    opts = QuantizeOptions(str(model), out, method, calib_samples=4, calib_seq_len=64,
                           eval_file=HELDOUT, eval_seq_len=64, **kwargs)
    return quantize_model(opts, show_progress=False)


@pytest.fixture(scope="session")
def awq_tiny(tmp_path_factory: pytest.TempPathFactory,
             tiny_qwen2_dir: Path) -> tuple[Path, QuantizeReport]:
    out = tmp_path_factory.mktemp("awq") / "tiny-qwen2-awq"
    return out, quantize_tiny(tiny_qwen2_dir, out, "awq")


@pytest.fixture(scope="session")
def fp8_tiny(tmp_path_factory: pytest.TempPathFactory,
             tiny_llama_dir: Path) -> tuple[Path, QuantizeReport]:
    out = tmp_path_factory.mktemp("fp8") / "tiny-llama-fp8"
    return out, quantize_tiny(tiny_llama_dir, out, "fp8")
