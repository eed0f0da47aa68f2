"""What every guided-decoding backend shares: constraints compiled off the engine loop, one
at a time, with a time limit, a bounded cache, and a cap on runaway compiles."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from pkv.core.structured_output.params import ConstraintCompilerBusyError, StructuredOutputsParams

# Past this many runaway compiles (each holding a thread and a core), new ones are refused.
MAX_ABANDONED_COMPILES = 2


class CompilingBackend:
    """Subclasses build one grammar in `_build`; this caches them and bounds the time."""

    name = "?"

    def __init__(self, timeout_s: float = 30.0, cache_size: int = 64) -> None:
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._pending: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pkv-guided")
        self._abandoned: set[Any] = set()  # compiles past the limit, still running

    def _build(self, params: StructuredOutputsParams) -> Any:
        raise NotImplementedError

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (cached); ValueError if invalid or over the time limit."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            future = self._pending.get(key)
            if future is None:
                self._abandoned = {f for f in self._abandoned if not f.done()}
                if len(self._abandoned) >= MAX_ABANDONED_COMPILES:
                    raise ConstraintCompilerBusyError(
                        "the constraint compiler is still busy with constraints that exceeded "
                        "the time limit; retry later")
                future = self._pool.submit(self._compile, params)
                self._pending[key] = future
        try:
            grammar = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._abandon(future)
            raise ValueError(f"compiling the {params.kind} constraint took longer than "
                             f"{self.timeout_s:g} s") from None
        finally:
            if future.done():
                with self._lock:
                    self._pending.pop(key, None)
        return grammar

    def _abandon(self, future: Any) -> None:
        """A thread cannot be stopped: leave it to finish on its own and give later
        constraints a fresh worker, so one poison constraint does not time them all out."""
        with self._lock:
            if future not in self._abandoned:
                self._abandoned.add(future)
                self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pkv-guided")

    def _compile(self, params: StructuredOutputsParams) -> Any:
        try:
            grammar = self._build(params)
        except ValueError as exc:
            raise ValueError(f"invalid {params.kind} constraint: {exc}") from None
        with self._lock:
            self._cache[params.key] = grammar
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def cache_sizes(self) -> dict[str, tuple[float, float | None, str]]:
        """Each cache's (size, bound, unit), for memory reports."""
        return {f"{self.name} compiled grammars": (len(self._cache), self.cache_size,
                                                   "grammars")}

    def is_cached(self, params: StructuredOutputsParams) -> bool:
        return params.key in self._cache
