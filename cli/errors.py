"""Turn user errors into one red line and exit code 2, never a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

# OSError: a path that is a file where a folder must be (or the reverse), a full disk, ...
_USER_ERRORS = (ValueError, OSError)


@contextmanager
def user_errors() -> Iterator[None]:
    """Report bad input (ValueError, missing files) as `error: ...` on stderr and exit 2
    (stdout may be a table or JSON that a script reads)."""
    try:
        yield
    except _USER_ERRORS as exc:
        # (the message as text: a path or hint in [brackets] is not Rich markup)
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}",
                                   highlight=False, soft_wrap=True)  # one line
        raise typer.Exit(code=2) from None


def output_file(value: Path | None) -> Path | None:
    """An option's file written at the end of a run: its folder must exist now, not be
    found missing after the run."""
    if value is None:
        return None
    value = value.expanduser()  # (a `--png=~/x.png` reaches us unexpanded by the shell)
    if not value.parent.is_dir():
        raise typer.BadParameter(f"the folder {value.parent} does not exist")
    return value
