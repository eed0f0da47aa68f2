"""`pkv bench kernels`: the 4-bit AWQ layer and the int8 LM head against float32, per kernel
flavour and row count (the timing and its table: pkv.cli.bench.kernels)."""

from __future__ import annotations

from typing import Annotated

import typer

from pkv.cli.bench.console import console, int_list
from pkv.cli.errors import user_errors


def kernels(
    rows: Annotated[str, typer.Option(help="Rows (tokens) per call; a list sweeps.")] = "1,16,64",
    isa: Annotated[str, typer.Option(help="Kernel flavours, comma-separated (avx512, avxvnni, "
                                          "avx2, generic); default: every one this CPU "
                                          "runs.")] = "",
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = 576,
    intermediate: Annotated[int, typer.Option(help="MLP width.")] = 1536,
    qkv: Annotated[int, typer.Option(help="qkv output width: (heads + 2 kv heads) x head "
                                          "size.")] = 960,
    vocab: Annotated[int, typer.Option(help="LM head rows.")] = 49152,
    group: Annotated[int, typer.Option(help="AWQ group size.")] = 64,
    repeat: Annotated[int, typer.Option(help="Timed calls (the median is kept).")] = 20,
    footprint_mib: Annotated[float, typer.Option(help="Weights each kernel rotates through, "
                                                      "so calls read memory, not cache.")] = 96.0,
) -> None:
    """The 4-bit AWQ layer and int8 LM head vs float32, per kernel flavour and row count
    (random weights; defaults: SmolLM2-135M's shape)."""
    from pkv.cli.bench.kernels import KernelShape, print_kernels

    with user_errors():
        flavours = [f.strip() for f in isa.split(",") if f.strip()]
        print_kernels(console, KernelShape(hidden, intermediate, qkv, vocab, group),
                      int_list(rows, "--rows"), flavours, repeats=repeat,
                      footprint_mib=footprint_mib)
