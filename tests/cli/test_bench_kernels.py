"""`pkv bench kernels`: rows for every flavour and row count on a tiny shape, weights rotated
past the footprint (no speed is asserted), and the command's table, CPU line and errors."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pkv.cli.bench.cpu_info import cpu_summary
from pkv.cli.bench.kernels import AWQ_LAYER, INT8_HEAD, KernelRow, KernelShape, _Rotation
from pkv.cli.bench.kernels import _float_linear, time_kernels
from pkv.cli.main import app
from pkv.csrc import cpp_build

TINY = KernelShape(hidden=64, intermediate=128, qkv=96, vocab=200, group=32)


@pytest.mark.skipif(bool(cpp_build.unusable_reasons()), reason="no C++ toolchain")
def test_rows_cover_each_flavour_kernel_and_row_count() -> None:
    flavour = cpp_build.selected_flavour()
    calls: list[int] = []
    rows = time_kernels(TINY, rows=(1, 9), flavours=[flavour], repeats=2, footprint_mib=0.5,
                        advance=lambda: calls.append(1))
    assert [(r.isa, r.kernel, r.rows) for r in rows] == [
        (flavour, AWQ_LAYER, 1), (flavour, AWQ_LAYER, 9),
        (flavour, INT8_HEAD, 1), (flavour, INT8_HEAD, 9)]
    assert len(calls) == 4
    for row in rows:
        assert isinstance(row, KernelRow) and row.quantized_ms > 0 and row.float_ms > 0
        assert row.speedup == pytest.approx(row.float_ms / row.quantized_ms)


def test_rotation_copies_weights_past_the_footprint_and_cycles() -> None:
    import torch

    gen = torch.Generator().manual_seed(0)
    linear = _float_linear(64, 32, gen)  # 8 KiB of weights
    rotation = _Rotation([linear], footprint_bytes=20 * 1024)
    assert len(rotation.copies) == 3
    weights = {c[0].weight.data_ptr() for c in rotation.copies}
    assert len(weights) == 3  # distinct memory, not views of one tensor
    assert all(torch.equal(c[0].weight, linear.weight) for c in rotation.copies)
    call = rotation.caller({64: torch.randn(2, 64)})
    for expected in (1, 2, 0):
        call()
        assert rotation.next == expected


def test_bad_shapes_and_flavours_are_value_errors() -> None:
    with pytest.raises(ValueError, match="group size 48 must divide hidden"):
        KernelShape(hidden=64, group=48)
    with pytest.raises(ValueError, match="qkv .100. must be a multiple of 8"):
        KernelShape(hidden=64, intermediate=128, qkv=100, group=32)
    with pytest.raises(ValueError, match="cannot run the 'sse9' kernels"):
        time_kernels(TINY, flavours=["sse9"])
    with pytest.raises(ValueError, match="rows .at least one. and repeats must be >= 1"):
        time_kernels(TINY, rows=())


@pytest.mark.skipif(bool(cpp_build.unusable_reasons()), reason="no C++ toolchain")
def test_command_prints_the_table_and_cpu_line() -> None:
    flavour = cpp_build.selected_flavour()
    result = CliRunner().invoke(app, ["bench", "kernels", "--rows", "1,2", "--isa", flavour,
                                      "--hidden", "64", "--intermediate", "128", "--qkv", "96",
                                      "--vocab", "200", "--group", "32", "--repeat", "2",
                                      "--footprint-mib", "0.2"])
    assert result.exit_code == 0, result.output
    assert cpu_summary().split(" | ")[0] in result.output
    assert "float32 / quant" in result.output and INT8_HEAD in result.output
    bad = CliRunner().invoke(app, ["bench", "kernels", "--group", "100"])
    assert bad.exit_code == 2 and "group size 100 must divide hidden (576)" in bad.output
    assert "Traceback" not in bad.output
