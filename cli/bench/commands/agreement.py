"""`pkv bench agreement`: next-token agreement of integer activations, or of a smaller KV
cache dtype, with float32 on the same weights (the measurement and its table:
pkv.cli.bench.agreement)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from pkv.cli.bench.console import console
from pkv.cli.errors import user_errors


def agreement(
    model: Annotated[Optional[str], typer.Argument(help="HF folder, .gguf or Hub id; default: bundled")] = None,
    awq_activations: Annotated[str, typer.Option(help="The activations measured: int8, int16 or float32.")] = "int8",
    kv_cache_dtype: Annotated[str, typer.Option(help="The KV cache dtype measured (e.g. int8, fp8_e4m3); auto: float32.")] = "auto",
    num_prompts: Annotated[int, typer.Option(min=1, help="Prompts: the start of one of pkv's source files each.")] = 16,
    input_len: Annotated[int, typer.Option(help="Prompt tokens.")] = 32,
    output_len: Annotated[int, typer.Option(help="Greedy tokens per prompt: positions = prompts x this.")] = 125,
) -> None:
    """Top-1 agreement of int8 / int16 activations, or a KV cache dtype, with float32 over
    greedy positions."""
    from pkv.cli.bench.agreement import agreement_table, measure, text_prompts
    from pkv.cli.bench.cpu_info import print_cpu_line
    from pkv.core.engine.llm import LLM
    from pkv.csrc import cpp_build

    with user_errors():
        if awq_activations not in ("int8", "int16", "float32"):
            raise ValueError("--awq-activations must be int8, int16 or float32, got "
                             f"{awq_activations!r}")
        if awq_activations == "float32" and kv_cache_dtype in ("auto", "float32"):
            raise ValueError("nothing to measure: give --awq-activations int8/int16 or a "
                             "--kv-cache-dtype other than float32")
        if min(num_prompts, input_len, output_len) < 1:
            raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
        common = {"kv_cache_memory": "512MiB", "show_progress": False}
        reference = LLM(model, **common)
        # Steps of at most the integer GEMV's rows: every token, prompts included, goes
        # through it (longer prefill steps take the float32 GEMM).
        rows = cpp_build.kernels().awq_gemv_max_rows
        steps = {"max_num_batched_tokens": rows} if awq_activations != "float32" else {}
        candidate = LLM(model, awq_activations=awq_activations, kv_cache_dtype=kv_cache_dtype,
                        **steps, **common)
        prompts = text_prompts(reference.get_tokenizer(), num_prompts, input_len)
        print_cpu_line(console)
        kv = candidate.llm_engine.runner.kv_format.name
        label = " + ".join([f"{awq_activations} activations"] * (awq_activations != "float32")
                           + [f"KV {kv}"] * (kv != "float32"))
        console.print(agreement_table(measure(reference, candidate, prompts, output_len,
                                              label)))
