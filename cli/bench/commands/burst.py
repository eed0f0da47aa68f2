"""`pkv bench burst`: every client at once against a server with small limits, and its verdict
(the burst and its table: pkv.cli.bench.burst)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Optional

import typer

from pkv.cli.bench.console import console
from pkv.cli.errors import output_file, user_errors
from pkv.cli.http import auth_headers, base_url


def burst(
    model: Annotated[Optional[str], typer.Argument(help="HF folder or .gguf; default: bundled")] = None,
    clients: Annotated[int, typer.Option(help="Requests sent at the same moment.")] = 200,
    max_num_seqs: Annotated[int, typer.Option(help="The server's running batch.")] = 16,
    max_waiting_requests: Annotated[int, typer.Option(help="The server's queue bound.")] = 32,
    kv_cache_memory: Annotated[str, typer.Option(help="The server's KV pool.")] = "48MiB",
    max_model_len: Annotated[int, typer.Option(help="The server's longest sequence.")] = 1024,
    max_tokens: Annotated[int, typer.Option(help="Tokens each request asks for.")] = 16,
    url: Annotated[Optional[str], typer.Option(help="Burst a running server instead.")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="PKV_API_KEY", help="Its API key.")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", dir_okay=False, callback=output_file, help="Write every figure here.")] = None,
) -> None:
    """Every client at once against a server with small limits: answers by status (200, or
    503/429 with Retry-After; never 500) and /health latency during the burst."""
    import secrets
    from contextlib import nullcontext

    from pkv.cli.bench import report
    from pkv.cli.bench.burst import burst as send_burst, burst_table
    from pkv.cli.serve_process import start_pkv_serve

    with user_errors():
        if clients < 1 or max_num_seqs < 1 or max_waiting_requests < 1 or max_tokens < 1:
            raise ValueError("--clients, --max-num-seqs, --max-waiting-requests and "
                             "--max-tokens must be >= 1")
        key = api_key if url else secrets.token_hex(16)
        args = ["--max-num-seqs", str(max_num_seqs), "--max-waiting-requests",
                str(max_waiting_requests), "--kv-cache-memory", kv_cache_memory,
                "--max-model-len", str(max_model_len),
                *([model] if model else [])]
        body = {"prompt": "Write a short poem about the sea.", "max_tokens": max_tokens,
                "ignore_eos": True}
        server = nullcontext((base_url(url), 0)) if url else start_pkv_serve(args, key or "")
        with server as (base, _):
            result = asyncio.run(send_burst(base, auth_headers(key),
                                            [body, {**body, "stream": True}], clients))
        where = url or (f"max-num-seqs {max_num_seqs}, max-waiting-requests "
                        f"{max_waiting_requests}, KV {kv_cache_memory}")
        console.print(burst_table({"burst": result}, f"pkv bench burst: {clients} clients at "
                                  f"once, half streamed ({where})"))
        problems = result.problems()
        if json_path:
            report.write_json(json_path, {
                "statuses": dict(result.statuses), "stream_errors": result.stream_errors,
                "without_retry_after": result.without_retry_after,
                "transport_errors": result.transport_errors, "examples": result.examples,
                "health_p99_ms": result.health_p99_ms, "health_max_ms": result.health_max_ms,
                "seconds": result.seconds, "problems": problems}, console)
        if problems:
            console.print("[bold red]burst failed[/]: " + "; ".join(problems))
            raise typer.Exit(1)
        console.print("[bold green]burst passed[/]: every answer 200 or an overload refusal "
                      "with Retry-After, /health always up")
