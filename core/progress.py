"""Rich progress bars for long work (loading, generating), off when not wanted."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)

T = TypeVar("T")


def make_progress(transient: bool = True, disable: bool = False) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                    transient=transient, disable=disable)


def progress_bar(items: Iterable[T], total: int, description: str,
                 enabled: bool = True) -> Iterator[T]:
    """Yield from `items` while a bar counts them."""
    if not enabled:
        yield from items
        return
    with make_progress() as progress:
        task = progress.add_task(description, total=total, info="")
        for item in items:
            yield item
            progress.advance(task)
