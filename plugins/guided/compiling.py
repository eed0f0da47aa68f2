"""What every guided-decoding backend shares: constraints compiled off the engine loop, one
at a time, with a time limit, a bounded cache, and a cap on runaway compiles."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
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
        deadline = time.monotonic() + self.timeout_s
        while True:
            future = self._submitted(params)
            try:
                return future.result(timeout=max(0.0, deadline - time.monotonic()))
            except CancelledError:  # queued behind a runaway compile whose worker was replaced:
                deadline = time.monotonic() + self.timeout_s  # its own time starts again
                continue
            except FutureTimeout:
                self._abandon(future)
                raise ValueError(f"compiling the {params.kind} constraint took longer than "
                                 f"{self.timeout_s:g} s") from None
            finally:
                if future.done():
                    with self._lock:
                        if self._pending.get(key) is future:
                            del self._pending[key]

    def _submitted(self, params: StructuredOutputsParams) -> Any:
        """The future of `params`' grammar: cached, compiling, or submitted now."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                done: Future[Any] = Future()
                done.set_result(self._cache[key])
                return done
            future = self._pending.get(key)
            if future is not None and not future.done() and future in self._abandoned:
                raise ValueError(f"compiling the {params.kind} constraint took longer than "
                                 f"{self.timeout_s:g} s; it is still running")  # (ran away)
            if future is None or future.cancelled():
                self._abandoned = {f for f in self._abandoned if not f.done()}
                if len(self._abandoned) >= MAX_ABANDONED_COMPILES:
                    raise ConstraintCompilerBusyError(
                        "the constraint compiler is still busy with constraints that exceeded "
                        "the time limit; retry later")
                future = self._pool.submit(self._compile, params)
                self._pending[key] = future
            return future

    def _abandon(self, future: Any) -> None:
        """A thread cannot be stopped: leave a runaway compile to finish on its own and give
        later constraints a fresh worker, so one poison constraint does not time them all
        out. Compiles queued behind it are cancelled; their callers submit them again."""
        with self._lock:
            if future.cancel() or future in self._abandoned:
                return  # (one still queued: its own worker is the one that ran away)
            self._abandoned.add(future)
            self._pool.shutdown(wait=False, cancel_futures=True)
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
