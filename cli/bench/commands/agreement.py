"""`pkv bench agreement`: next-token agreement of integer activations with float32 ones on
the same weights (the measurement and its table: pkv.cli.bench.agreement)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from pkv.cli.bench.console import console
from pkv.cli.errors import user_errors


def agreement(
    model: Annotated[Optional[str], typer.Argument(help="HF folder, .gguf or Hub id; default: bundled")] = None,
    awq_activations: Annotated[str, typer.Option(help="The activations measured: int8 or int16.")] = "int8",
    num_prompts: Annotated[int, typer.Option(help="Prompts: the start of one of pkv's source files each.")] = 16,
    input_len: Annotated[int, typer.Option(help="Prompt tokens.")] = 32,
    output_len: Annotated[int, typer.Option(help="Greedy tokens per prompt: positions = prompts x this.")] = 125,
) -> None:
    """Top-1 agreement of int8 / int16 activations with float32 over greedy positions."""
    from pkv.cli.bench.agreement import agreement_table, measure, text_prompts
    from pkv.cli.bench.cpu_info import print_cpu_line
    from pkv.core.engine.llm import LLM
    from pkv.csrc import cpp_build

    with user_errors(console):
        if awq_activations not in ("int8", "int16"):
            raise ValueError(f"--awq-activations must be int8 or int16, got {awq_activations!r}")
        if min(num_prompts, input_len, output_len) < 1:
            raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
        common = {"kv_cache_memory": "512MiB", "show_progress": False}
        reference = LLM(model, **common)
        # Steps of at most the integer GEMV's rows: every token, prompts included, goes
        # through it (longer prefill steps take the float32 GEMM).
        rows = cpp_build.kernels().awq_gemv_max_rows
        candidate = LLM(model, awq_activations=awq_activations, max_num_batched_tokens=rows,
                        **common)
        prompts = text_prompts(reference.get_tokenizer(), num_prompts, input_len)
        print_cpu_line(console)
        console.print(agreement_table(measure(reference, candidate, prompts, output_len,
                                              awq_activations)))
