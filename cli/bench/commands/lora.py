"""`pkv bench lora`: multi-LoRA throughput against the base model, back to back in one
process, and the memory each adapter takes (the runs and their tables: pkv.cli.bench.lora)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pkv.cli.bench.console import console, int_list
from pkv.cli.bench.engines import add_adapters, lora_options, warm_up
from pkv.cli.errors import output_file, user_errors


def lora(
    lora_modules: Annotated[list[str], typer.Option(help="NAME=PATH of a PEFT LoRA adapter (repeat the flag).")],
    model: Annotated[Optional[str], typer.Argument(help="The adapters' base model; default: bundled SmolLM2.")] = None,
    batch: Annotated[str, typer.Option(help="Batch sizes, comma-separated (batch 1 uses the first adapter; larger ones all, evenly).")] = "1,64",
    num_prompts: Annotated[Optional[int], typer.Option(min=1, help="Requests per run (default: 2 x batch, at least 4).")] = None,
    input_len: Annotated[int, typer.Option(help="Prompt tokens (synthetic prompts).")] = 32,
    output_len: Annotated[int, typer.Option(help="New tokens per request.")] = 128,
    kv_cache_memory: Annotated[str, typer.Option(help="KV pool size of each engine.")] = "1GiB",
    profile: Annotated[bool, typer.Option(help="Time the adapter runs' steps by phase.")] = False,
    rounds: Annotated[int, typer.Option(help="Runs of each configuration, in turn; the fastest is kept.")] = 2,
    json_path: Annotated[Optional[Path], typer.Option("--json", dir_okay=False, callback=output_file, help="Write every figure here.")] = None,
) -> None:
    """Multi-LoRA throughput against the base model, back to back, and memory per adapter."""
    from pkv.cli.bench import report
    from pkv.cli.bench.cpu_info import cpu_summary, print_cpu_line
    from pkv.cli.bench.lora import lora_table, memory_table, run_batch
    from pkv.cli.bench.workload import workload_prompts
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm_engine import LLMEngine

    with user_errors():
        batches = int_list(batch, "--batch")
        options = dict(model=model, kv_cache_memory=kv_cache_memory, max_num_seqs=max(batches))
        lora_engine = LLMEngine(EngineConfig(**options, **lora_options(lora_modules)))
        requests = add_adapters(lora_engine, lora_modules)
        base = LLMEngine(EngineConfig(**options))
        warm_up(base)
        warm_up(lora_engine, requests[0])
        print_cpu_line(console)
        opts = dict(input_len=input_len, seed=0, dataset=None, shared_prefix_len=0)
        runs = []
        for b in batches:
            prompts = workload_prompts(base, "synthetic", num_prompts or max(4, 2 * b), opts)
            console.print(f"[bold]batch {b}[/]: {len(prompts)} prompts, ~{input_len} tokens in, "
                          f"{output_len} out")
            runs.append(run_batch(base, lora_engine, requests, prompts, output_len, b, profile,
                                  max(1, rounds)))
        console.print(lora_table(runs))
        console.print(memory_table(lora_engine))
        if profile:
            console.print(report.profile_table([r.adapters for r in runs]))
        if json_path:
            report.write_json(json_path, {"cpu": cpu_summary(),
                                          "runs": [r.as_json() for r in runs]}, console)
