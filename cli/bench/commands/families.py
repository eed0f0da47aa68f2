"""`pkv bench families`: decode speed of every model family on random weights of one shape,
beside Llama (the models, the runs and their table: pkv.cli.bench.families)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pkv.cli.bench.console import console, int_list
from pkv.cli.errors import output_file, user_errors


def families(
    family: Annotated[str, typer.Option(help="Families, comma-separated (default: all).")] = "",
    batch: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")] = "1,64",
    output_len: Annotated[int, typer.Option(help="New tokens per request.")] = 32,
    json_path: Annotated[Optional[Path], typer.Option("--json", dir_okay=False, callback=output_file, help="Write every figure here.")] = None,
) -> None:
    """Decode speed of every model family on random weights of one shape, beside Llama."""
    from pkv.cli.bench import report
    from pkv.cli.bench.cpu_info import cpu_summary, print_cpu_line
    from pkv.cli.bench.families import FAMILY_SHAPES, bench_families, families_table

    with user_errors():
        names = [f.strip() for f in family.split(",") if f.strip()] or list(FAMILY_SHAPES)
        unknown = sorted(set(names) - set(FAMILY_SHAPES))
        if unknown:
            raise ValueError(f"unknown families {unknown}; known: {', '.join(FAMILY_SHAPES)}")
        batches = int_list(batch, "batch")
        print_cpu_line(console)
        rows = bench_families(names, batches, output_len)
    console.print(families_table(rows, batches))
    if json_path:
        report.write_json(json_path, {"cpu": cpu_summary(), "rows": [
            {"family": r.family, "path": r.path,
             "decode_tokens_per_s": {str(b): v for b, v in r.decode_tps.items()}}
            for r in rows]}, console)
