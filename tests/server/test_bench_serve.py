"""`pkv bench serve` against the test server reports every percentile."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from pkv.cli.main import app


def test_bench_serve_reports_every_percentile(server, tmp_path: Path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    result = CliRunner().invoke(app, [
        "bench", "serve", "--url", server.base_url, "--api-key", server.api_key,
        "--concurrency", "1,3", "--num-prompts", "3", "--input-len", "8", "--output-len", "6",
        "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--json", str(out),
        "--plot", str(png)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [r["concurrency"] for r in data["runs"]] == [1, 3]
    for run in data["runs"]:
        assert run["completed"] == 3 and run["failed"] == 0
        for name in ("ttft", "tpot", "itl"):
            for p in (50, 90, 99):
                assert run[f"p{p}_{name}_ms"] > 0, (name, p)
        assert run["output_throughput"] > 0 and run["goodput"] == run["request_throughput"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_serve_fails_where_every_request_does(server):
    result = CliRunner().invoke(app, [
        "bench", "serve", "--url", server.base_url, "--api-key", server.api_key,
        "--model", "no-such-model", "--concurrency", "1", "--num-prompts", "2",
        "--input-len", "8", "--output-len", "4"])
    shown = " ".join(result.output.split())
    assert result.exit_code == 2 and "every request failed at concurrency 1" in shown
    assert "HTTP 404" in shown and "no-such-model" in shown  # the server's own words


def test_offline_bench_with_openai_baseline(server, tmp_path: Path, tiny_llama_dir: Path):
    out = tmp_path / "openai.json"
    result = CliRunner().invoke(app, [
        "bench", str(tiny_llama_dir), "--batch", "2", "--num-prompts", "2", "--input-len", "4",
        "--output-len", "3", "--kv-cache-memory", "8MiB", "--warmup", "0",
        "--baseline", "openai", "--url", f"{server.base_url}/v1", "--api-key", server.api_key,
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    baseline = json.loads(out.read_text())["baseline"]
    assert baseline["name"].startswith("openai") and baseline["output_throughput"] > 0
    assert baseline["ratio"] > 0
