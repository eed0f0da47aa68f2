"""The `pkv bench` Typer app: `pkv bench [MODEL] ...` runs offline throughput (`run`), and
every other benchmark is a subcommand registered here, in the order `--help` lists them.

A command's module (pkv.cli.bench.commands) imports its machinery only when it runs: every
`pkv` invocation builds this app, and `pkv --help` should not pay for torch.
"""

from __future__ import annotations

import click
import typer
from typer.core import TyperGroup

from pkv.cli.bench.commands.agreement import agreement
from pkv.cli.bench.commands.attention import attention
from pkv.cli.bench.commands.burst import burst
from pkv.cli.bench.commands.compare import compare
from pkv.cli.bench.commands.families import families
from pkv.cli.bench.commands.guided import guided
from pkv.cli.bench.commands.kernels import kernels
from pkv.cli.bench.commands.lora import lora
from pkv.cli.bench.commands.moe import moe
from pkv.cli.bench.commands.embed import embed
from pkv.cli.bench.commands.offload import offload
from pkv.cli.bench.commands.random_gguf import random_gguf
from pkv.cli.bench.commands.run import run
from pkv.cli.bench.commands.serve import serve
from pkv.cli.bench.commands.soak import soak
from pkv.cli.bench.commands.spec import spec
from pkv.cli.bench.commands.tools import tools
from pkv.cli.bench.commands.window import window


class _DefaultRun(TyperGroup):
    """`pkv bench [MODEL] ...` means `pkv bench run [MODEL] ...`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = ["run", *args]
        return super().parse_args(ctx, args)


bench_app = typer.Typer(cls=_DefaultRun, no_args_is_help=False, add_completion=False,
                        help="Benchmarks: offline throughput (default) or `serve` (online).")
bench_app.command("run")(run)
bench_app.command("attention")(attention)
bench_app.command("spec")(spec)
bench_app.command("lora")(lora)
bench_app.command("compare")(compare)
bench_app.command("moe")(moe)
bench_app.command("kernels")(kernels)
bench_app.command("guided")(guided)
bench_app.command("serve")(serve)
bench_app.command("families")(families)
bench_app.command("window")(window)
bench_app.command("offload")(offload)
bench_app.command("embed")(embed)
bench_app.command("soak")(soak)
bench_app.command("burst")(burst)
bench_app.command("tools")(tools)
bench_app.command("random-gguf")(random_gguf)
bench_app.command("agreement")(agreement)
