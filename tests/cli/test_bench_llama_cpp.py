"""`pkv bench --baseline llama.cpp`: its result table read back by column (the table as
llama-batched-bench prints it), the KV cache type it runs with, and the one-line errors where
no build can be found."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkv.cli.bench.llama_cpp import cache_type, find_batched_bench, parse_row, run_batched_bench

OUTPUT = """main: n_kv_max = 4352, n_batch = 2048, n_ubatch = 512, n_threads = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |    128 |   16 |   2560 |    1.204 |   425.25 |   10.871 |   188.39 |   12.075 |   212.01 |

llama_perf_context_print:        load time =     150.12 ms
"""


def test_the_result_row_is_read_by_column():
    row = parse_row(OUTPUT)
    assert row["B"] == 16 and row["T_PP s"] == 1.204 and row["T_TG s"] == 10.871
    assert row["S_TG t/s"] == 188.39 and row["T s"] == 12.075


def test_output_without_a_table_is_a_clear_error():
    with pytest.raises(ValueError, match="no result table"):
        parse_row("error: failed to load model\n")


def test_a_missing_build_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ValueError, match="no llama-batched-bench there"):
        find_batched_bench(str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match="put it on PATH"):
        find_batched_bench(None)
    binary = tmp_path / "llama-batched-bench"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert find_batched_bench(str(tmp_path)) == binary
    assert find_batched_bench(None) == binary


def test_llama_cpp_runs_with_the_kv_cache_type_like_pkvs(tmp_path: Path):
    assert [cache_type(f) for f in ("float16", "bfloat16", "int8")] == ["f16", "bf16", "q8_0"]
    assert cache_type("float32") == cache_type("fp8_e4m3") == "f16"  # its default, fast path
    # A stand-in build that keeps its arguments and prints the table above.
    args = tmp_path / "args"
    binary = tmp_path / "llama-batched-bench"
    binary.write_text(f"#!/bin/sh\necho \"$@\" > {args}\ncat <<'EOF'\n{OUTPUT}EOF\n")
    binary.chmod(0o755)
    result = run_batched_bench(binary, tmp_path / "m.gguf", 16, 32, 128, 2, "q8_0")
    assert "-ctk q8_0 -ctv q8_0" in args.read_text()
    assert "-npl 16" in args.read_text() and "-t 2" in args.read_text()
    assert result.decode_s == 10.871 and result.prefill_s == 1.204
    # 128 tokens a sequence: the first from the prefill, 127 decode steps, as pkv's
    assert "-ntg 127" in args.read_text()
    assert result.output_tokens == 16 * 128 and result.decode_tokens == 16 * 127
