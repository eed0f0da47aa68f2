"""`pkv bench serve`: streaming chat requests against a running OpenAI-compatible server, a
sweep of concurrency levels (the client and its figures: pkv.cli.bench.serve)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Optional

import typer

from pkv.cli.bench.console import console, int_list
from pkv.cli.errors import output_file, user_errors
from pkv.cli.http import auth_headers, base_url


def serve(
    url: Annotated[str, typer.Option(help="Base URL of an OpenAI-compatible server.")],
    api_key: Annotated[Optional[str], typer.Option(envvar="PKV_API_KEY", help="Bearer key.")] = None,
    model: Annotated[Optional[str], typer.Option(help="Model name (default: the server's first).")] = None,
    concurrency: Annotated[str, typer.Option(help="Concurrent requests; a list sweeps.")] = "1,16,64",
    num_prompts: Annotated[Optional[int], typer.Option(min=1, help="Requests per level (default 2 x concurrency).")] = None,
    input_len: Annotated[int, typer.Option(help="Prompt length (about, in tokens).")] = 32,
    output_len: Annotated[int, typer.Option(help="New tokens per request.")] = 128,
    request_rate: Annotated[float, typer.Option(help="Poisson arrivals per second (inf: all at once).")] = float("inf"),
    seed: Annotated[int, typer.Option(help="Seed for prompts and arrivals.")] = 0,
    slo_ttft_ms: Annotated[Optional[float], typer.Option(help="TTFT goal for goodput.")] = None,
    slo_tpot_ms: Annotated[Optional[float], typer.Option(help="TPOT goal for goodput.")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", dir_okay=False, callback=output_file, help="Write every figure here.")] = None,
    plot: Annotated[Optional[Path], typer.Option(dir_okay=False, callback=output_file, help="PNG over the concurrency sweep.")] = None,
) -> None:
    """Online benchmark: streaming chat requests against a running server."""
    from pkv.cli.bench import report
    from pkv.cli.bench.serve import check_server, run_level, synthetic_messages

    with user_errors():
        levels = int_list(concurrency, "--concurrency")
        if request_rate <= 0:
            raise ValueError("--request-rate must be > 0 (or inf)")
        if input_len < 1 or output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        url = base_url(url)
        headers = auth_headers(api_key)
        model = model or check_server(url, headers)
        summaries = []
        for level in levels:
            prompts = synthetic_messages(num_prompts or 2 * level, input_len, seed)
            result = asyncio.run(run_level(
                url, model, headers, prompts, output_len, level, request_rate,
                slo_ttft_ms / 1000 if slo_ttft_ms else None,
                slo_tpot_ms / 1000 if slo_tpot_ms else None, seed))
            failed = [r.error for r in result.records if not r.ok]
            if failed and len(failed) == len(result.records):  # nothing to measure
                raise ValueError(f"every request failed at concurrency {level}, e.g. "
                                 f"{failed[0]}")
            if failed:
                console.print(f"[yellow]{len(failed)} requests failed, e.g. {failed[0]}[/]")
            summaries.append(result.summary())
        console.print(report.serve_table(summaries, url))
        if json_path:
            report.write_json(json_path, {"url": url, "model": model, **summaries[-1],
                                          "runs": summaries}, console)
        if plot:
            report.plot_sweep(plot, levels, {"output tok/s": [s["output_throughput"]
                                                              for s in summaries]},
                              "ms", {"TTFT p50": [s["p50_ttft_ms"] for s in summaries],
                                     "TPOT p50": [s["p50_tpot_ms"] for s in summaries]},
                              "concurrency", console)
