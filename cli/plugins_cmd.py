"""`pkv plugins`: every discovered plugin, what it provides, and what is usable here."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pkv.cli.errors import user_errors

console = Console()


def plugins(
    device: Annotated[Optional[str], typer.Option(help="Check usability for cpu or cuda.")] = None,
) -> None:
    """List plugins (name, distribution, version, provides) and backend usability."""
    import torch

    from pkv.core.registry import discover

    with user_errors():
        if device not in (None, "cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    registry = discover()
    table = Table(title="pkv plugins (entry-point group `pkv`)")
    for column in ("plugin", "distribution", "version", "provides", "status"):
        table.add_column(column)
    for info in registry.plugins:
        status = f"[red]failed: {escape(info.error)}[/]" if info.error else "[green]loaded[/]"
        table.add_row(info.name, info.distribution, info.version,
                      ", ".join(info.provides) or "-", status)
    console.print(table)
    backends = Table(title=f"attention backends on {device}")
    for column in ("backend", "usable", "why not / what", "target"):
        backends.add_column(column)
    for name, spec in sorted(registry.attention_backends.items()):
        reasons = spec.unusable_reasons(device)
        backends.add_row(name, "[red]no[/]" if reasons else "[green]yes[/]",
                         "; ".join(reasons) or spec.description, spec.target)
    console.print(backends)
    loaders = Table(title="weight loaders (--quantization)")
    for column in ("name", "reads", "target"):
        loaders.add_column(column)
    for name, spec in sorted(registry.weight_loaders.items()):
        loaders.add_row(name, spec.description, spec.target)
    console.print(loaders)
    parsers = Table(title="tool call parsers (--tool-call-parser; auto reads the chat template)")
    for column in ("name", "format", "auto picks it for templates with"):
        parsers.add_column(column)
    for name, spec in sorted(registry.tool_parsers.items()):
        parsers.add_row(name, escape(spec.description), escape(", ".join(spec.markers) or "-"))
    console.print(parsers)
    console.print(_features())
    with user_errors():
        console.print(_kernel_flavours())


def _features() -> Table:
    """Engine features that are options rather than plugins, and where they run."""
    table = Table(title="serving features (engine options)")
    for column in ("feature", "turn on with", "runs"):
        table.add_column(column)
    table.add_row("speculative decoding", "--speculative-config '{\"method\": \"ngram\", ...}' "
                  "or '{\"model\": DRAFT, ...}'",
                  "drafts verified in the ordinary batch, on every backend; a draft model's KV "
                  "shares the pool; with tensor and pipeline parallelism too")
    table.add_row("LoRA adapters", "--enable-lora --lora-modules NAME=PATH",
                  "batched per adapter slot: inside the C++ decoder stack on CPU, the Python "
                  "layer loop elsewhere; each rank its share of the adapters under tensor "
                  "parallelism")
    return table


def _kernel_flavours() -> Table:
    """The ISA flavours of the C++ kernels: which this CPU runs, and which one runs."""
    from pkv.csrc import cpp_build

    selected = cpp_build.selected_flavour()
    runnable = cpp_build.runnable_flavours()
    table = Table(title="C++ CPU kernels (PKV_CPU_ISA picks the flavour)")
    for column in ("flavour", "compile flags", "this CPU runs it", "selected"):
        table.add_column(column)
    for flavour in cpp_build.FLAVOURS:
        table.add_row(flavour, " ".join(cpp_build.compile_flags(flavour)),
                      "[green]yes[/]" if flavour in runnable else "[red]no[/]",
                      "[bold]<- runs[/]" if flavour == selected else "")
    return table
