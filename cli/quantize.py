"""`pkv quantize MODEL --awq|--fp8 --output DIR`: quantize a float model into a checkpoint
that pkv, vLLM and AutoAWQ load."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from pkv.cli.errors import user_errors

console = Console()


def quantize(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Argument(help="HF folder or .gguf; default: bundled SmolLM2.")] = None,
    output: Annotated[Optional[Path], typer.Option(help="Folder to write (must not exist or be empty).")] = None,
    awq: Annotated[bool, typer.Option("--awq", help="4-bit AWQ (AutoAWQ GEMM format).")] = False,
    fp8: Annotated[bool, typer.Option("--fp8", help="FP8 e4m3 weights (compressed-tensors format).")] = False,
    w_bit: Annotated[int, typer.Option(help="AWQ weight bits (4).")] = 4,
    group_size: Annotated[Optional[int], typer.Option(help="AWQ group size (default 128, else 64 or 32 if 128 does not divide).")] = None,
    zero_point: Annotated[bool, typer.Option(help="AWQ asymmetric quantization with zero points.")] = True,
    search: Annotated[bool, typer.Option(help="AWQ scale search; --no-search is plain round-to-nearest.")] = True,
    clip: Annotated[bool, typer.Option(help="AWQ weight-clipping search.")] = True,
    calib: Annotated[Optional[Path], typer.Option(help="Calibration text, one passage per line (default: shipped).")] = None,
    calib_samples: Annotated[int, typer.Option(help="Calibration samples.")] = 16,
    calib_seq_len: Annotated[int, typer.Option(help="Tokens per calibration sample.")] = 256,
    fp8_scheme: Annotated[str, typer.Option(help="FP8 scales: channel or tensor.")] = "channel",
    eval: Annotated[Optional[Path], typer.Option("--eval", help="Text to report perplexity on, before and after.")] = None,
    backend: Annotated[str, typer.Option(help="AWQ implementation: pkv, or autoawq if installed.")] = "pkv",
) -> None:
    """Quantize a model to AWQ 4-bit or FP8 and report size (and perplexity with --eval)."""
    with user_errors():
        from pkv.quantize.pipeline import QuantizeOptions, check_options, quantize_model

        if awq == fp8:
            raise ValueError("choose exactly one of --awq and --fp8")
        # (typer vendors click: compare the source by name, not by enum identity)
        given = [name for name in _ONLY_FOR["fp8" if awq else "awq"]
                 if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ValueError(f"{flags}: for {'--fp8' if awq else '--awq'} only")
        if output is None:
            raise ValueError("--output DIR is required")
        if backend not in ("pkv", "autoawq"):
            raise ValueError(f"--backend must be pkv or autoawq, got {backend!r}")
        unread = [flag for flag, given in (("--eval", eval is not None),
                                           ("--no-search", not search), ("--no-clip", not clip))
                  if given]
        if backend == "autoawq" and unread:  # (AutoAWQ searches and clips its own way)
            raise ValueError(f"{', '.join(unread)}: for the pkv backend only")
        opts = QuantizeOptions(model, output, "awq" if awq else "fp8", w_bit, group_size,
                               zero_point, search, clip, calib, calib_samples, calib_seq_len,
                               fp8_scheme, eval)
        check_options(opts)  # before any progress bar is drawn
        if backend == "autoawq":
            from pkv.quantize.autoawq_backend import quantize_with_autoawq

            report = quantize_with_autoawq(opts)
        else:
            report = _with_progress(opts, quantize_model)
        _print_report(opts, report)


# The options that only one method reads.
_ONLY_FOR = {
    "awq": ("w_bit", "group_size", "zero_point", "search", "clip", "calib", "calib_samples",
            "calib_seq_len", "backend"),
    "fp8": ("fp8_scheme",),
}


def _with_progress(opts, quantize_model):  # noqa: ANN001, ANN202 - thin glue
    from pkv.core.progress import make_progress

    with make_progress(transient=False) as progress:
        task = progress.add_task("AWQ layers" if opts.method == "awq" else "FP8", total=None,
                                 info="")

        def on_layer(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total, info=f"layer {done}/{total}")

        return quantize_model(opts, on_layer=on_layer)


def _print_report(opts, report) -> None:  # noqa: ANN001
    for notice in report.notices:
        console.print(f"[yellow]notice:[/] {notice}")
    table = Table(title=f"pkv quantize --{opts.method} -> {opts.output}")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    table.add_row("disk size", _mib(report.size_before), _mib(report.size_after))
    if report.perplexity_before is not None:
        table.add_row(f"perplexity ({opts.eval_file.name})", f"{report.perplexity_before:.3f}",
                      f"{report.perplexity_after:.3f}")
    for name, ratio in report.awq_vs_rtn.items():
        table.add_row(f"{name} error vs round-to-nearest", "1.00", f"{ratio:.2f}")
    table.add_row("wall time", "", f"{report.seconds:.1f} s")
    console.print(table)


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"
