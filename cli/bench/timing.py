"""Timing helpers shared by the micro-benchmarks (`pkv bench moe`, `pkv bench kernels`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def interleaved_ms(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median ms of each of `fns`, called in turn every repeat so that a busy machine slows
    them alike."""
    for _ in range(max(2, repeats // 10)):  # warm-up: allocator, oneDNN primitives
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, record in zip(fns, times):
            start = time.perf_counter()
            fn()
            record.append(time.perf_counter() - start)
    return [1000 * statistics.median(t) for t in times]
