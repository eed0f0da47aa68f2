"""`pkv run-batch`: a file of OpenAI Batch API requests answered offline (vLLM's run-batch).

The engine and its limits take `pkv serve`'s options, from `--config` (YAML or a shipped
recipe); the requests run through the same endpoints, batched by the engine as a server's
concurrent requests are.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from pkv.cli.errors import output_file, user_errors

console = Console(stderr=True)


def run_batch(
    input_file: Annotated[Path, typer.Option("--input-file", "-i", exists=True, dir_okay=False, help="JSONL of {custom_id, method, url, body} (OpenAI's Batch API input).")],
    output_file: Annotated[Path, typer.Option("--output-file", "-o", dir_okay=False, callback=output_file, help="JSONL written here: one {id, custom_id, response, error} per request, in input order.")],
    model: Annotated[Optional[str], typer.Argument(help="HF folder, .gguf or Hub id; default: bundled SmolLM2.")] = None,
    config: Annotated[Optional[Path], typer.Option(help="`pkv serve` options as YAML, or a shipped recipe's name.")] = None,
    max_concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight at once.")] = 256,
) -> None:
    """Answer every request of a batch file with one engine and write the results."""
    from pkv.cli.http import auth_headers
    from pkv.cli.serve import serve_options, start_app
    from pkv.core.progress import make_progress
    from pkv.core.server.batch import answer_batch, parse_batch
    from pkv.core.server.middleware import split_keys

    with user_errors():
        options = serve_options(config)
        if model is not None:
            options["model"] = model
        if not output_file.parent.is_dir():
            raise ValueError(f"--output-file: folder {output_file.parent} does not exist")
        with input_file.open("rb") as f:  # (decoded line by line: one bad byte, one line)
            lines = parse_batch(f)
        if not lines:
            raise ValueError(f"{input_file} holds no requests")
        async_llm, app, _ = start_app(options)
        failed = 0
        try:
            with make_progress(transient=False) as progress:
                task = progress.add_task("requests", total=len(lines), info="")

                def done(result: dict[str, Any]) -> None:
                    nonlocal failed
                    response = result["response"]
                    failed += result["error"] is not None or response["status_code"] != 200
                    progress.update(task, advance=1, info=f"{failed} failed" if failed else "")

                # as the first tenant, where the config names keys
                key = next(iter(split_keys(options.get("api_key"))), None)
                results = asyncio.run(answer_batch(app, lines, max_concurrency, done,
                                                   auth_headers(key)))
        finally:
            async_llm.shutdown()
        _write_jsonl(output_file, results)
    console.print(f"[bold]{len(results)} requests[/]: {len(results) - failed} answered, "
                  f"{failed} failed; wrote {output_file}", highlight=False)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Written whole or not at all (a partial file under the final name would look done)."""
    import json

    partial = path.with_name(path.name + ".partial")
    with partial.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(partial, path)
