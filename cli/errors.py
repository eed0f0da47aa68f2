"""Turn user errors into one red line and exit code 2, never a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

_USER_ERRORS = (ValueError, FileNotFoundError, PermissionError)


@contextmanager
def user_errors(console: Console | None = None) -> Iterator[None]:
    """Report bad input (ValueError, missing files) as `error: ...` and exit 2."""
    try:
        yield
    except _USER_ERRORS as exc:
        (console or Console(stderr=True)).print(f"[bold red]error:[/] {exc}", highlight=False,
                                              soft_wrap=True)  # one line, never wrapped
        raise typer.Exit(code=2) from None

