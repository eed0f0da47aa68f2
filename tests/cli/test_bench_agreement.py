"""`pkv bench agreement` on the bundled GGUF (its Q4_1 linears run the 4-bit kernel, which
takes int8 activations; its KV cache in 8 bits): every position counted, the rate in range;
bad input in one line."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from pkv.cli.main import app


def test_int8_activations_agree_with_float32_position_by_position():
    result = CliRunner().invoke(app, ["bench", "agreement", "--num-prompts", "2",
                                      "--input-len", "16", "--output-len", "10"])
    assert result.exit_code == 0, result.output
    row = re.search(r"int8 activations\s*│\s*(\d+)\s*│\s*(\d+)\s*│\s*([\d.]+)%", result.output)
    assert row is not None, result.output
    positions, agreeing, rate = int(row[1]), int(row[2]), float(row[3])
    assert positions == 20 and 10 <= agreeing <= 20  # int8 noise moves a few tokens at most
    assert abs(rate - 100 * agreeing / positions) < 0.01


def test_an_int8_kv_cache_agrees_with_float32_position_by_position():
    result = CliRunner().invoke(app, ["bench", "agreement", "--awq-activations", "float32",
                                      "--kv-cache-dtype", "int8", "--num-prompts", "2",
                                      "--input-len", "16", "--output-len", "10"])
    assert result.exit_code == 0, result.output
    row = re.search(r"KV int8\s*│\s*(\d+)\s*│\s*(\d+)\s*│", result.output)
    assert row is not None, result.output
    assert int(row[1]) == 20 and 16 <= int(row[2]) <= 20


def test_nothing_to_measure_is_refused_in_one_line():
    result = CliRunner().invoke(app, ["bench", "agreement", "--awq-activations", "float32"])
    assert result.exit_code != 0
    assert "nothing to measure" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["bench", "agreement", "--awq-activations", "int4"])
    assert result.exit_code != 0 and "must be int8, int16 or float32" in result.output
