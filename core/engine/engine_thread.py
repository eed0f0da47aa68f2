"""EngineThread: the one thread that builds an engine and then steps it.

Why one thread for both: OpenMP (libgomp, under torch and the CPU kernels) keeps a pool of
worker threads for each thread that starts parallel regions, and once the pools hold more
threads than there are CPUs it spins ~100 times before sleeping instead of ~300,000. An engine
loaded on the main thread (whose pool stays) and stepped on another therefore ran every step
with workers that fall asleep between parallel regions: 64 embedding inputs through a small
BERT took 1.3-1.4x as long as on the thread that loaded them (two cores).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")
logger = logging.getLogger("pkv.engine")


class EngineThread:
    """A daemon thread that runs what it is handed, in order: `call` waits for a result (build
    the engine there), `start_loop` hands over the engine loop. The thread outlives its loop,
    idle, until the process exits: tensor-parallel workers it starts die with the thread that
    started them (their parent-death signal), not with the loop."""

    def __init__(self, name: str = "pkv-engine") -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], object], Future | None]] = (
            queue.SimpleQueue())
        self._looping = threading.Event()
        self._loop_done = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], T]) -> T:
        """fn() on this thread: its result, or its exception raised here."""
        done: Future[T] = Future()
        self._tasks.put((fn, done))
        return done.result()

    def start_loop(self, loop: Callable[[], None]) -> None:
        """Run `loop` on this thread from now on (returns at once)."""
        self._looping.set()
        self._tasks.put((loop, None))

    @property
    def looping(self) -> bool:
        """Whether the loop was started and has not returned."""
        return self._looping.is_set() and not self._loop_done.is_set()

    def join_loop(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the loop to return."""
        self._loop_done.wait(timeout)

    def _serve(self) -> None:
        while True:
            fn, done = self._tasks.get()
            if done is None:
                try:
                    fn()
                except BaseException:  # the loop reports its own failures; the thread stays
                    logger.exception("the engine loop raised")
                self._loop_done.set()
                continue
            try:
                done.set_result(fn())
            except BaseException as exc:  # handed to the caller, raised there
                done.set_exception(exc)
