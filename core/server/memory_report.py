"""What a serving process holds besides its weights and KV pool: every cache that fills
while it serves, with its size and its bound, and (when traced) the Python heap by line.

The caches that fill during a server's first minutes, all bounded:

    compiled grammars      64 per guided backend (LRU)           plugins/guided/compiling.py
    token masks            64 MiB (outlines; LRU by bytes)       plugins/guided/outlines_backend.py
    prefix-cache blocks    the KV pool's blocks (they are the pool)  core/sched/block_pool.py
    LoRA adapters          what was loaded by name (explicit; slots preallocated)
    stored responses       1024 (LRU, an hour each)              core/server/responses_api.py
    glibc free pages       handed back at every idle (malloc_trim)  core/worker/memory.py

`PKV_TRACEMALLOC=1` in a server's environment traces the Python heap (slower) so that a
report can list where it grew since the first report.
"""

from __future__ import annotations

import os
import tracemalloc
from dataclasses import dataclass, field
from typing import Any

TRACE_ENV = "PKV_TRACEMALLOC"


@dataclass
class CacheSize:
    """One cache: how full it is and how full it may get, in `unit`s."""

    size: float | None  # None: not observable
    bound: float | None  # None: grows only by explicit loads
    unit: str

    def as_dict(self) -> dict[str, Any]:
        return {"size": self.size, "bound": self.bound, "unit": self.unit}


def engine_caches(engine: Any) -> dict[str, CacheSize]:
    """The engine's caches (call on the engine thread)."""
    pool = engine.kv_cache.pool
    caches = {"prefix-cache blocks": CacheSize(pool.num_cached_blocks, pool.num_blocks,
                                               "blocks")}
    sizes = getattr(engine.guided, "cache_sizes", None)  # third-party backends may not say
    for name, (size, bound, unit) in (sizes() if sizes else {}).items():
        caches[name] = CacheSize(size, bound, unit)
    if engine.lora is not None:
        caches["LoRA adapters (host)"] = CacheSize(
            sum(a.nbytes for a in engine.lora.adapters.values()), None, "bytes")
    return caches


@dataclass
class HeapTracer:
    """Python heap growth by source line since the first `report` (when tracing)."""

    baseline: Any = None
    _enabled: bool = field(default_factory=lambda: os.environ.get(TRACE_ENV) == "1")

    def start(self) -> None:
        if self._enabled and not tracemalloc.is_tracing():
            tracemalloc.start(1)

    def report(self, top: int = 10) -> dict[str, Any]:
        if not tracemalloc.is_tracing():
            return {"python_heap_bytes": None, "top_growth": []}
        snapshot = tracemalloc.take_snapshot()
        if self.baseline is None:
            self.baseline = snapshot
        diff = snapshot.compare_to(self.baseline, "lineno")
        growth = [{"where": str(s.traceback[0]), "bytes": s.size_diff, "count": s.count_diff}
                  for s in diff[:top] if s.size_diff > 0]
        return {"python_heap_bytes": tracemalloc.get_traced_memory()[0], "top_growth": growth}
