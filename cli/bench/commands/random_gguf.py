"""`pkv bench random-gguf`: write a GGUF of a real model's shape with random weights in the
Q4_K_M mix (pkv.cli.bench.random_gguf), to load and decode a model of that size here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pkv.cli.bench.console import console
from pkv.cli.errors import user_errors


def random_gguf(
    out: Annotated[Path, typer.Argument(help="The .gguf file to write.")],
    shape: Annotated[str, typer.Option(
        help="llama-3.1-8b, llama-3.2-1b or qwen2.5-0.5b.")] = "llama-3.1-8b",
    seed: Annotated[int, typer.Option(help="Seed of the random blocks.")] = 0,
) -> None:
    """Write a random-weight GGUF of a real shape (Q4_K_M mix) to benchmark its size."""
    from pkv.cli.bench.random_gguf import write_random_gguf

    with user_errors():
        size = write_random_gguf(out, shape, seed)
        console.print(f"wrote {out} ({size / 2**30:.2f} GiB); run it with `pkv bench {out}`")
