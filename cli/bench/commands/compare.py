"""`pkv bench compare`: two models on the same prompts in one process, in turn, round after
round (the rounds and their table: pkv.cli.bench.compare)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pkv.cli.bench.console import console, int_list
from pkv.cli.bench.engines import warm_up
from pkv.cli.errors import output_file, user_errors


def compare(
    candidate: Annotated[str, typer.Argument(help="The model measured (B): HF folder, .gguf or Hub id, e.g. the output of `pkv quantize --awq`.")],
    baseline_model: Annotated[Optional[str], typer.Option(help="The model it is measured against (A); default: bundled SmolLM2, float32.")] = None,
    batch: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")] = "1,64",
    num_prompts: Annotated[Optional[int], typer.Option(min=1, help="Requests per run (default: 2 x batch, at least 4).")] = None,
    input_len: Annotated[int, typer.Option(help="Prompt tokens (synthetic prompts).")] = 32,
    output_len: Annotated[int, typer.Option(help="New tokens per request.")] = 128,
    rounds: Annotated[int, typer.Option(help="Runs of each model per batch size, in turn (A B, B A, ...); the ratio is taken per round.")] = 3,
    kv_cache_memory: Annotated[str, typer.Option(help="KV pool size of each engine.")] = "1GiB",
    awq_activations: Annotated[str, typer.Option(help="The candidate's AWQ / GGUF decode activations: float32, int16 or int8.")] = "float32",
    json_path: Annotated[Optional[Path], typer.Option("--json", dir_okay=False, callback=output_file, help="Write every figure here.")] = None,
) -> None:
    """Two models on the same prompts in one process, in turn: each round's tok/s of both and
    B / A (say, a 4-bit model against the float model it was quantized from)."""
    from pkv.cli.bench import report
    from pkv.cli.bench.compare import compare_table, run_rounds
    from pkv.cli.bench.cpu_info import cpu_summary, print_cpu_line
    from pkv.cli.bench.workload import workload_prompts
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm_engine import LLMEngine

    with user_errors():
        batches = int_list(batch, "--batch")
        if rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {rounds}")
        # Sequences no longer than the workload's: a long-context model's max_model_len
        # (128k) would ask a pool of --kv-cache-memory for one whole sequence.
        options = dict(kv_cache_memory=kv_cache_memory, max_num_seqs=max(batches),
                       max_model_len=input_len + output_len)
        candidate_config = EngineConfig(model=candidate, awq_activations=awq_activations,
                                        **options)  # errors before loading anything
        engines = [LLMEngine(EngineConfig(model=baseline_model, **options)),
                   LLMEngine(candidate_config)]
        vocabs = [e.model_config.vocab_size for e in engines]
        if vocabs[0] != vocabs[1]:
            raise ValueError(f"the two models must share a vocabulary to take the same prompts: "
                             f"{vocabs[0]} vs {vocabs[1]} tokens")
        for engine in engines:
            warm_up(engine)
        print_cpu_line(console)
        opts = dict(input_len=input_len, seed=0, dataset=None, shared_prefix_len=0)
        runs = []
        for b in batches:
            prompts = workload_prompts(engines[0], "synthetic", num_prompts or max(4, 2 * b),
                                       opts)
            console.print(f"[bold]batch {b}[/]: {len(prompts)} prompts, ~{input_len} tokens "
                          f"in, {output_len} out, {rounds} round(s)")
            runs.append(run_rounds(*engines, prompts, output_len, b, rounds))
        names = [e.model_name for e in engines]
        console.print(compare_table(runs, *names))
        if json_path:
            report.write_json(json_path, {"cpu": cpu_summary(), "baseline": names[0],
                                          "candidate": names[1],
                                          "runs": [r.as_json() for r in runs]}, console)
