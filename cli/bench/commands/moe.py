"""`pkv bench moe`: one sparse MoE layer against a dense MLP with the same active parameters
(the timing and its table: pkv.cli.bench.moe)."""

from __future__ import annotations

from typing import Annotated

import typer

from pkv.cli.bench.console import console, int_list
from pkv.cli.errors import user_errors


def moe(
    batch: Annotated[str, typer.Option(help="Tokens per forward; a list (1,64) sweeps.")] = "1,64",
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = 1024,
    experts: Annotated[int, typer.Option(help="Experts in the layer.")] = 8,
    top_k: Annotated[int, typer.Option(help="Experts per token.")] = 2,
    expert_intermediate: Annotated[int, typer.Option(help="Each expert's width.")] = 512,
    repeat: Annotated[int, typer.Option(help="Timed forwards (the median is kept).")] = 50,
) -> None:
    """One sparse MoE layer vs a dense MLP with the same active parameters (random weights)."""
    from pkv.cli.bench.moe import print_moe_vs_dense

    with user_errors():
        print_moe_vs_dense(console, batch_sizes=int_list(batch, "--batch"), hidden=hidden,
                           num_experts=experts, top_k=top_k,
                           expert_intermediate=expert_intermediate, repeats=repeat)
