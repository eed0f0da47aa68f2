"""`pkv bench offload`: the prefix cache's disk tier against none, on more documents than
the KV pool holds, and a restart (the runs and their table: pkv.cli.bench.offload)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pkv.cli.bench.console import console
from pkv.cli.errors import output_file, user_errors


def offload(
    model: Annotated[Optional[str], typer.Argument(help="HF folder, .gguf or Hub id; default: bundled SmolLM2.")] = None,
    num_docs: Annotated[int, typer.Option(help="Shared documents.")] = 8,
    doc_tokens: Annotated[int, typer.Option(help="Tokens per document.")] = 2048,
    num_requests: Annotated[int, typer.Option(help="Measured requests (document + question), after one warm-up read of each document.")] = 32,
    pool_docs: Annotated[float, typer.Option(help="KV pool size, in documents.")] = 2.0,
    question_tokens: Annotated[int, typer.Option(help="Tokens of each request's question.")] = 16,
    max_tokens: Annotated[int, typer.Option(help="New tokens per request.")] = 4,
    seed: Annotated[int, typer.Option(help="Seed of the documents and their order.")] = 0,
    kv_offload_dir: Annotated[Optional[str], typer.Option(help="Folder of the disk tier (default: a temporary one).")] = None,
    tensor_parallel_size: Annotated[int, typer.Option(help="Ranks to split the model (and each block's KV heads) over.")] = 1,
    pipeline_parallel_size: Annotated[int, typer.Option(help="Pipeline stages to split the layers (and each block's KV) over.")] = 1,
    json_path: Annotated[Optional[Path], typer.Option("--json", dir_okay=False, callback=output_file, help="Write every figure here.")] = None,
) -> None:
    """Prefill tokens and time to first token with the prefix cache's disk tier and without,
    and whether a restarted engine hits on its first request."""
    from pkv.cli.bench import report
    from pkv.cli.bench.cpu_info import print_cpu_line
    from pkv.cli.bench.offload import offload_table, run_offload_bench

    with user_errors():
        if min(num_docs, doc_tokens, num_requests, question_tokens, max_tokens) < 1:
            raise ValueError("num_docs, doc_tokens, num_requests, question_tokens and "
                             "max_tokens must be >= 1")
        if pool_docs < 1:
            raise ValueError(f"pool_docs must be >= 1, got {pool_docs}")
        print_cpu_line(console)
        result = run_offload_bench(model, num_docs, doc_tokens, num_requests, pool_docs,
                                   question_tokens, max_tokens, seed, kv_offload_dir,
                                   tensor_parallel_size, pipeline_parallel_size)
    console.print(offload_table(result))
    if json_path:
        report.write_json(json_path, result, console)
