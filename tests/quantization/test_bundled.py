"""The bundled SmolLM2 through `pkv quantize` (CLI) and back through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pkv import LLM, SamplingParams
from pkv.cli.main import app
from pkv.tests.quantization.conftest import HELDOUT

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.parametrize("method, extra", [
    ("--awq", ["--calib-samples", "2", "--calib-seq-len", "64", "--no-clip"]),
    ("--fp8", []),
])
def test_quantized_smollm2_answers_and_reports(tmp_path: Path, method: str,
                                               extra: list[str]) -> None:
    out = tmp_path / "smol"
    result = CliRunner().invoke(app, ["quantize", method, "--output", str(out), "--eval",
                                      str(HELDOUT), *extra])
    assert result.exit_code == 0, result.output
    assert "disk size" in result.output and "perplexity (heldout.txt)" in result.output
    perplexity_row = next(line for line in result.output.splitlines() if "perplexity" in line)
    before, after = (float(v) for v in perplexity_row.split("│")[2:4])
    assert after < before * 1.5  # 4-bit costs some perplexity; a broken model costs 100x
    if method == "--awq":
        assert "notice: group size 128 does not divide the input sizes [576, 1536]; using 64" \
            in result.output
    llm = LLM(str(out), kv_cache_memory="32MiB", max_model_len=256, show_progress=False)
    answer = llm.chat(QUESTION, SamplingParams(max_tokens=12, temperature=0))
    assert "Paris" in answer[0].outputs[0].text


def test_plugins_lists_the_weight_loaders() -> None:
    result = CliRunner().invoke(app, ["plugins"])
    assert result.exit_code == 0
    for name in ("gguf", "awq", "fp8"):
        assert f"weights:{name}" in result.output
