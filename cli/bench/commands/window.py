"""`pkv bench window`: KV blocks one long generation holds over time, with a sliding window
and without (the runs and their table: pkv.cli.bench.window)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pkv.cli.bench.console import console
from pkv.cli.errors import output_file, user_errors


def window(
    window: Annotated[int, typer.Option(help="Sliding window of every layer, in tokens.")] = 256,
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens.")] = 32,
    output_len: Annotated[int, typer.Option(help="New tokens.")] = 2048,
    every: Annotated[int, typer.Option(help="Sample the block count every this many tokens.")] = 256,
    hybrid: Annotated[Optional[str], typer.Option(help="gemma2 or gemma3: layer-blocks held vs the least.")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", dir_okay=False, callback=output_file, help="Write every figure here.")] = None,
) -> None:
    """KV blocks one long generation holds over time, with a sliding window and without (or,
    with --hybrid, a hybrid model's layer-blocks against the least they could be)."""
    from pkv.cli.bench import report
    from pkv.cli.bench.cpu_info import print_cpu_line
    from pkv.cli.bench.window import hybrid_vs_least, window_table, window_vs_full

    with user_errors():
        # (the request's last step frees its blocks: a sample needs a step before it)
        if window < 1 or output_len <= every or every < 1:
            raise ValueError("window and every must be >= 1, output_len > every")
        if hybrid not in (None, "gemma2", "gemma3"):
            raise ValueError(f"--hybrid takes gemma2 or gemma3, not {hybrid!r}")
        print_cpu_line(console)
        runs = (hybrid_vs_least(hybrid, prompt_len, output_len, every) if hybrid
                else window_vs_full(window, prompt_len, output_len, every))
    if hybrid:
        last = max(runs["pkv"])
        console.print(f"{hybrid} at {last} tokens: pkv holds "
                      f"{runs['pkv'][last] / runs['least'][last]:.2f}x the least its layers "
                      f"need; one table for all layers would hold "
                      f"{runs['one table'][last] / runs['least'][last]:.2f}x")
    console.print(window_table(runs, 16, "layer-blocks" if hybrid else "KV blocks"))
    if json_path:
        report.write_json(json_path, {name: {str(k): v for k, v in r.items()}
                                      for name, r in runs.items()}, console)
