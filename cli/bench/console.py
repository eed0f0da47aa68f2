"""What every `pkv bench` command shares: the console it prints to, and its lists of sizes
given as comma-separated options (`--batch 1,16,64`)."""

from __future__ import annotations

import sys

from rich.console import Console

# Tables are wide: keep them readable when output goes to a file or a CI log.
console = Console(width=None if sys.stdout.isatty() else 160)


def int_list(value: str, name: str) -> list[int]:
    """`value` ("1,16,64") as integers, each >= 1; a ValueError naming the option `name`."""
    try:
        values = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be integers separated by commas, got {value!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    return values
