"""`pkv bench spec`: the same prompts with and without speculative decoding, two engines in
one process, back to back (the runs and their table: pkv.cli.bench.spec)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pkv.cli.bench.console import console, int_list
from pkv.cli.bench.engines import warm_up
from pkv.cli.errors import output_file, user_errors


def spec(
    model: Annotated[Optional[str], typer.Argument(help="HF folder, .gguf or Hub id; default: bundled SmolLM2.")] = None,
    speculative_config: Annotated[str, typer.Option(help='Speculative decoding as JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4}.')] = '{"method": "ngram", "num_speculative_tokens": 4}',
    workload: Annotated[str, typer.Option(help="Workloads, comma-separated: repeat, synthetic.")] = "repeat,synthetic",
    batch: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")] = "1",
    num_prompts: Annotated[Optional[int], typer.Option(min=1, help="Requests per run (default: 2 x batch, at least 4).")] = None,
    input_len: Annotated[int, typer.Option(help="Prompt tokens of synthetic prompts.")] = 32,
    shared_prefix_len: Annotated[int, typer.Option(help="Tokens all synthetic prompts share first (a cached document: the draft's K/V of it is reused).")] = 0,
    output_len: Annotated[int, typer.Option(help="New tokens per request.")] = 128,
    kv_cache_memory: Annotated[str, typer.Option(help="KV pool size of each engine.")] = "1GiB",
    seed: Annotated[int, typer.Option(help="Seed for synthetic prompts.")] = 0,
    profile: Annotated[bool, typer.Option(help="Time the speculating steps by phase (propose / forward / sample).")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", dir_okay=False, callback=output_file, help="Write every figure here.")] = None,
) -> None:
    """With and without speculative decoding, back to back: tok/s, speed-up, acceptance,
    and whether the greedy outputs are identical."""
    from pkv.cli.bench import report
    from pkv.cli.bench.cpu_info import cpu_summary, print_cpu_line
    from pkv.cli.bench.spec import print_runs, run_pair
    from pkv.cli.bench.workload import WORKLOADS, workload_prompts
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm_engine import LLMEngine

    with user_errors():
        batches = int_list(batch, "--batch")
        if shared_prefix_len < 0:
            raise ValueError("--shared-prefix-len must be >= 0")
        workloads = [w.strip() for w in workload.split(",") if w.strip()]
        unknown = [w for w in workloads if w not in WORKLOADS]
        if unknown or not workloads:
            raise ValueError(f"--workload takes {', '.join(WORKLOADS)}, got {workload!r}")
        options = dict(model=model, kv_cache_memory=kv_cache_memory, max_num_seqs=max(batches),
                       seed=seed)
        EngineConfig(**options, speculative_config=speculative_config)  # errors before loading
        engines = [LLMEngine(EngineConfig(**options)),
                   LLMEngine(EngineConfig(**options, speculative_config=speculative_config))]
        for engine in engines:
            warm_up(engine)
        print_cpu_line(console)
        opts = dict(input_len=input_len, seed=seed, dataset=None,
                    shared_prefix_len=shared_prefix_len)
        runs = []
        for w in workloads:
            for b in batches:
                prompts = workload_prompts(engines[0], w, num_prompts or max(4, 2 * b), opts)
                console.print(f"[bold]{w}, batch {b}[/]: {len(prompts)} prompts of "
                              f"~{sum(map(len, prompts)) // len(prompts)} tokens, "
                              f"{output_len} out (ignore_eos), greedy")
                runs.append(run_pair(*engines, w, prompts, output_len, b, profile))
        print_runs(console, runs, speculative_config, profile)
        if json_path:
            report.write_json(json_path, {"speculative_config": speculative_config,
                                          "cpu": cpu_summary(),
                                          "runs": [r.as_json() for r in runs]}, console)
