"""`pkv bench guided`: structured outputs per guided decoding backend, one engine each (the
schemas, the runs and their table: pkv.cli.bench.guided)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pkv.cli.bench.console import console
from pkv.cli.errors import output_file, user_errors


def guided(
    model: Annotated[Optional[str], typer.Argument(help="HF folder or .gguf; default: bundled")] = None,
    num_requests: Annotated[int, typer.Option(help="Guided requests across the 5 schemas.")] = 50,
    batch: Annotated[int, typer.Option(help="Batch for guided vs unguided throughput.")] = 32,
    max_tokens: Annotated[int, typer.Option(help="Token limit per request.")] = 128,
    kv_cache_memory: Annotated[str, typer.Option(help="KV pool size.")] = "1GiB",
    backends: Annotated[str, typer.Option(help="Comma-separated guided decoding backends.")] = "outlines,xgrammar",
    json_path: Annotated[Optional[Path], typer.Option("--json", dir_okay=False, callback=output_file, help="Write every figure here.")] = None,
) -> None:
    """Structured outputs per backend: keyword-suite coverage, validity over 5 schemas,
    compile time cold and cached, mask cost per step at batch 1 and 32, throughput."""
    from pkv.cli.bench import report
    from pkv.cli.bench.cpu_info import print_cpu_line
    from pkv.cli.bench.guided import backends_table, run_guided_bench
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm_engine import LLMEngine

    with user_errors():
        if min(num_requests, batch, max_tokens) < 1:
            raise ValueError("--num-requests, --batch and --max-tokens must be >= 1")
        results = {}
        print_cpu_line(console)
        for backend in [b.strip() for b in backends.split(",") if b.strip()]:
            engine = LLMEngine(EngineConfig(model=model, kv_cache_memory=kv_cache_memory,
                                            max_model_len=1024, max_num_seqs=max(batch, 64),
                                            guided_decoding_backend=backend))
            results[backend] = run_guided_bench(engine, num_requests, batch, max_tokens,
                                                console)
            engine.shutdown()
        console.print(backends_table(results))
        if json_path:
            report.write_json(json_path, results, console)
