"""`pkv bench embed`: embedding throughput, one input per request against a batch of them
(the runs and their table: pkv.cli.bench.embed)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pkv.cli.bench.console import console
from pkv.cli.errors import output_file, user_errors


def embed(
    model: Annotated[Optional[str], typer.Argument(help="An embedding model (HF folder or Hub id); default: a random BERT at all-MiniLM-L6-v2's shapes.")] = None,
    num_inputs: Annotated[int, typer.Option(help="Inputs embedded each way.")] = 64,
    min_words: Annotated[int, typer.Option(help="Fewest words per input.")] = 8,
    max_words: Annotated[int, typer.Option(help="Most words per input.")] = 64,
    repeats: Annotated[int, typer.Option(help="Alternating runs of each way (the best is kept).")] = 3,
    seed: Annotated[int, typer.Option(help="Seed of the inputs (and the random model).")] = 0,
    json_path: Annotated[Optional[Path], typer.Option("--json", dir_okay=False, callback=output_file, help="Write every figure here.")] = None,
) -> None:
    """Embedding throughput: the same inputs one request at a time, then all at once."""
    from pkv.cli.bench import report
    from pkv.cli.bench.cpu_info import print_cpu_line
    from pkv.cli.bench.embed import embed_table, run_embed_bench

    with user_errors():
        if min(num_inputs, min_words, repeats) < 1 or max_words < min_words:
            raise ValueError("num_inputs, min_words and repeats must be >= 1, max_words >= "
                             "min_words")
        print_cpu_line(console)
        result = run_embed_bench(model, num_inputs, min_words, max_words, repeats, seed)
    console.print(embed_table(result))
    if json_path:
        report.write_json(json_path, result, console)
