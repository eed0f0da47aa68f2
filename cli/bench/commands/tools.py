"""`pkv bench tools`: forced tool calls against a real server, each call's arguments checked
against its function's schema (the requests: pkv.cli.bench.tools)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Optional

import typer

from pkv.cli.bench.console import console
from pkv.cli.errors import user_errors
from pkv.cli.http import auth_headers, base_url


def tools(
    model: Annotated[Optional[str], typer.Argument(help="HF folder or .gguf; default: bundled")] = None,
    requests: Annotated[int, typer.Option(help="Forced tool-call requests.")] = 100,
    url: Annotated[Optional[str], typer.Option(help="A running server instead.")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="PKV_API_KEY", help="Its API key.")] = None,
) -> None:
    """Forced tool calls (required, named) against a real server: the share whose every
    call's arguments validate against the function's schema."""
    import secrets
    from contextlib import nullcontext

    import numpy as np

    from pkv.cli.bench.tools import first_model, forced_calls
    from pkv.cli.serve_process import start_pkv_serve

    with user_errors():
        if requests < 1:
            raise ValueError("--requests must be >= 1")
        key = api_key if url else secrets.token_hex(16)
        args = ["--max-model-len", "2048", "--kv-cache-memory", "256MiB",
                *([model] if model else [])]
        server = nullcontext((base_url(url), 0)) if url else start_pkv_serve(args, key or "")
        with server as (base, _):
            headers = auth_headers(key)
            run = asyncio.run(forced_calls(base, headers, first_model(base, headers), requests))
        console.print(f"forced tool calls: [bold]{run.valid}/{run.requests}[/] requests with "
                      f"every call valid ({run.calls} calls), median latency "
                      f"{np.median(run.seconds):.2f} s")
        for failure in run.failures[:5]:
            console.print(f"  failed: {failure}", highlight=False)
