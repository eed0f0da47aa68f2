"""`pkv bench moe`: the MoE-vs-dense rows on a tiny shape are well formed (no speed is
asserted), and the command prints them with the CPU line."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pkv.cli.bench.cpu_info import cpu_summary
from pkv.cli.bench.moe import MoeRow, moe_vs_dense
from pkv.cli.main import app

TINY = dict(hidden=32, num_experts=4, top_k=2, expert_intermediate=16, repeats=3)


def test_rows_are_well_formed() -> None:
    rows = moe_vs_dense(batch_sizes=(1, 5), **TINY)
    assert [r.batch for r in rows] == [1, 5]
    for row in rows:
        assert isinstance(row, MoeRow)
        assert row.moe_ms > 0 and row.dense_ms > 0
        assert row.ratio == pytest.approx(row.moe_ms / row.dense_ms)


def test_bad_sizes_are_value_errors() -> None:
    with pytest.raises(ValueError, match="top_k=5 exceeds num_experts=4"):
        moe_vs_dense(**{**TINY, "top_k": 5})
    with pytest.raises(ValueError, match=">= 1"):
        moe_vs_dense(batch_sizes=(0,), **TINY)


def test_command_prints_the_table_and_cpu_line() -> None:
    result = CliRunner().invoke(app, ["bench", "moe", "--batch", "1,3", "--hidden", "32",
                                      "--experts", "4", "--expert-intermediate", "16",
                                      "--repeat", "2"])
    assert result.exit_code == 0, result.output
    assert cpu_summary().split(" | ")[0] in result.output
    assert "MoE / dense" in result.output
    bad = CliRunner().invoke(app, ["bench", "moe", "--top-k", "9"])
    assert bad.exit_code == 2 and "top_k=9 exceeds num_experts=8" in bad.output
