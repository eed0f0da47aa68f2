"""The `pkv` command line (Typer). Bad input ends in a one-line error and a non-zero exit."""

from __future__ import annotations

from typing import Annotated

import typer

from pkv.cli.bench.app import bench_app
from pkv.cli.inspect_cache import inspect_cache
from pkv.cli.plugins_cmd import plugins
from pkv.cli.quantize import quantize
from pkv.cli.run_batch import run_batch
from pkv.cli.serve import serve

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="pkv: a self-hosted LLM inference engine.")
app.command(help="Serve a model over the OpenAI API.")(serve)
app.add_typer(bench_app, name="bench")
app.command(help="List plugins and which attention backends are usable here.")(plugins)
app.command(help="Quantize a model to AWQ 4-bit or FP8.")(quantize)
app.command("inspect-cache", help="Show the KV cache of a server or a simulation.")(inspect_cache)
app.command("run-batch", help="Answer a file of OpenAI Batch API requests offline.")(run_batch)


def _print_version(value: bool) -> None:
    if value:
        from pkv.core.version import pkv_version

        typer.echo(f"pkv {pkv_version()}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="Print pkv's version and exit.")] = False) -> None:
    """pkv: paged KV cache, continuous batching, OpenAI-compatible serving."""


if __name__ == "__main__":
    app()
