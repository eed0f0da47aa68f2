"""AsyncLLM: the engine stepped by one background thread (the one that built it, where the
caller builds it there: engine_thread.py), each request its own stream.

The HTTP event loop never runs a model step: it prepares requests (tokenize, validate) in a
worker thread, hands them to the engine thread through a queue, and awaits outputs that the
engine thread pushes into per-request asyncio queues. Requests join and leave between steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from pkv.core.engine.engine_thread import EngineThread
from pkv.core.engine.input_processor import PreparedRequest
from pkv.core.engine.llm_engine import LLMEngine
from pkv.core.engine.outputs import PoolingRequestOutput, RequestOutput
from pkv.core.lora.adapter import LoRARequest
from pkv.core.pooling.params import PoolingParams
from pkv.core.sample.sampling_params import SamplingParams
from pkv.core.worker.memory import release_free_memory

logger = logging.getLogger("pkv.engine")
T = TypeVar("T")

# Steps that fail one after another before the engine is declared dead (/health 503): one
# failure may be one bad batch; three in a row is a broken engine.
MAX_CONSECUTIVE_STEP_FAILURES = 3
# Seconds the engine stays idle before freed memory goes back to the OS. Handed back at once,
# the next request's first step faulted its activations in again: a 64-input embedding batch
# ~6,600 pages, ~13 ms of a ~180 ms request (2-vCPU Zen 5), paid by every burst.
IDLE_RELEASE_SECONDS = 1.0


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class EngineStepError(RuntimeError):
    """A step failed while this request was in flight."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting already."""


@dataclass(slots=True)
class RequestTimings:
    """When a request arrived, got its first token and finished (monotonic seconds)."""

    arrival: float
    num_samples: int = 1
    first_token: float | None = None
    last_token: float | None = None  # when its latest tokens came
    finished: float | None = None
    num_output_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)


def _fail_future(future: asyncio.Future, error: Exception) -> None:
    if not future.done():  # (its caller may have left)
        future.set_exception(error)


@dataclass
class _Stream:
    """Where the engine thread leaves a request's outputs for its reader. An output holds
    everything so far (token ids, text, logprobs), so only the newest is kept: a reader that
    falls behind (a client not reading its stream) skips to it, and holds one output, not
    every step's copy (quadratic in the output's length)."""

    loop: asyncio.AbstractEventLoop
    latest: RequestOutput | PoolingRequestOutput | Exception | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: RequestOutput | PoolingRequestOutput | Exception) -> None:
        self.loop.call_soon_threadsafe(self._keep, item)

    def _keep(self, item: RequestOutput | PoolingRequestOutput | Exception) -> None:
        last = self.latest
        # A failure, or the final output, is the last word (a failed step after a request
        # finished does not take its answer away).
        if not (isinstance(last, Exception) or getattr(last, "finished", False)):
            self.latest = item
        self.ready.set()

    async def get(self) -> RequestOutput | PoolingRequestOutput | Exception:
        """The newest output (or the failure) not yet read, once there is one."""
        while self.latest is None:
            self.ready.clear()
            await self.ready.wait()
        item, self.latest = self.latest, None
        return item


class RequestStream:
    """The outputs of one admitted request. Closing it before the request finished aborts
    the request; every holder closes it however it leaves (closing twice is harmless)."""

    def __init__(self, owner: AsyncLLM, request_id: str, stream: _Stream,
                 timings: RequestTimings) -> None:
        self.request_id = request_id
        self.timings = timings
        self.finished = False
        self._owner = owner
        self._stream = stream
        self._closed = False

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Each output of the request until the final one; raises the request's failure."""
        try:
            while not self.finished:
                item = await self._stream.get()
                if isinstance(item, Exception):
                    self.finished = True
                    # (counted, as a finish reason of its own: failures show in /metrics)
                    self.timings.finished = time.monotonic()
                    self.timings.finish_reasons = ["error"] * self.timings.num_samples
                    self._owner._report(self.timings)
                    raise item
                self._owner._record(item, self.timings)
                self.finished = item.finished
                yield item
        finally:
            self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._owner._release(self)


class AsyncLLM:
    """Serve many concurrent requests from one engine stepped in a background thread."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 1024,
                 on_request_finished: Callable[[RequestTimings], None] | None = None,
                 step_timeout: float = 120.0, thread: EngineThread | None = None) -> None:
        """`step_timeout`: seconds one step may run before the watchdog declares the engine
        wedged (fails everything in flight, /health 503). `thread`: the thread that built
        `engine`, to step it on (engine_thread.py says why); default a new one."""
        if not step_timeout > 0:
            raise ValueError(f"step_timeout must be > 0 seconds, got {step_timeout}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.step_timeout = step_timeout
        self._step_started: float | None = None  # monotonic start of the running step
        self._failed_steps = 0
        self.on_request_finished = on_request_finished
        # Seconds from a request's last tokens to its next (one step's, whatever their number)
        self.on_token_interval: Callable[[float], None] | None = None
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._queued = 0  # sequences submitted that the engine thread has not added yet
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._thread = thread or EngineThread()
        self._watchdog = threading.Thread(target=self._watch, name="pkv-watchdog", daemon=True)

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start_loop(self._run)
        self._watchdog.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.looping and self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine can serve no more: its loop failed, or a tensor-parallel rank died."""
        workers = self.engine.workers
        return self._failure or (workers.error if workers is not None else None)

    def stop(self) -> None:
        """Take no more steps: what is in flight fails ("the server is shutting down") once
        the running step ends, each stream with its API's error; shutdown() joins the loop."""
        if not self._stop.is_set() and self._streams:
            logger.warning("shutting down: ending %d requests still in flight",
                           len(self._streams))
        self._stop.set()
        self._wakeup.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop, failing whatever is still in flight."""
        self.stop()
        if self._thread.looping:
            self._thread.join_loop(timeout)
        # A step still running owns the collectives: then workers are killed, not told.
        self.engine.shutdown(force=self._thread.looping)

    # ---- requests ----------------------------------------------------------------------

    def check_admission(self, num_sequences: int = 1) -> None:
        """Raise EngineDeadError or QueueFullError if `num_sequences` more could not queue."""
        with self._lock:
            self._check_admission_locked(num_sequences)

    def _check_admission_locked(self, num_sequences: int) -> None:
        if self._stop.is_set() or not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the server is shutting down")
        # Sequences sent to the engine thread but not yet added count as waiting too: two
        # admissions between engine steps must see each other.
        waiting = self._queued + len(self.engine.scheduler.waiting)
        if waiting and waiting + num_sequences > self.max_waiting_requests:
            raise QueueFullError(f"{waiting} sequences are already waiting (the limit is "
                                 f"{self.max_waiting_requests}); retry later")

    async def prepare(self, request_id: str, prompt: str | list[int] | tuple[str, str],
                      params: SamplingParams | PoolingParams,
                      cache_salt: str | None = None,
                      lora_request: LoRARequest | None = None) -> PreparedRequest:
        """Tokenize and validate off the event loop; raises ValueError on bad input."""
        return await asyncio.to_thread(self.engine.prepare_request, request_id, prompt, params,
                                       cache_salt, lora_request)

    def submit(self, prepared: list[PreparedRequest]) -> list[RequestStream]:
        """Queue prepared requests for the engine: all of them or, raising EngineDeadError or
        QueueFullError, none. The decision and the queueing happen under one lock, so
        concurrent callers cannot all pass a check that only one of them fits."""
        loop = asyncio.get_running_loop()
        ids = [p.request_id for p in prepared]
        num_sequences = sum(len(p.children) for p in prepared)
        with self._lock:
            self._check_admission_locked(num_sequences)
            if len(set(ids)) < len(ids) or any(i in self._streams for i in ids):
                raise ValueError(f"request ids must be unique and not in use: {ids}")
            streams = []
            for p in prepared:
                stream = _Stream(loop)
                self._streams[p.request_id] = stream
                timings = RequestTimings(time.monotonic(), len(p.children))
                streams.append(RequestStream(self, p.request_id, stream, timings))
            self._queued += num_sequences
        for p in prepared:
            self._send("add", p)
        return streams

    async def generate(self, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
        """Submit a prepared request and yield its outputs until it finishes.

        Leaving the iteration early (client gone, cancelled) aborts the request.
        """
        [stream] = self.submit([prepared])
        try:
            async for output in stream.outputs():
                yield output
        finally:
            stream.close()

    def _release(self, stream: RequestStream) -> None:
        with self._lock:
            self._streams.pop(stream.request_id, None)
        if not stream.finished:
            self.abort(stream.request_id)
            stream.timings.finished = time.monotonic()
            stream.timings.finish_reasons = ["abort"] * stream.timings.num_samples
            self._report(stream.timings)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    async def call_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps (a consistent view)."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine loop is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._send("call", (fn, loop, future))
        if not self.is_alive:  # (it stopped meanwhile: nobody else would answer it)
            self._refuse_commands()
        return await future

    def _send(self, kind: str, payload: object) -> None:
        self._commands.put((kind, payload))
        self._wakeup.set()

    def _record(self, output: RequestOutput | PoolingRequestOutput,
                timings: RequestTimings) -> None:
        now = time.monotonic()
        if isinstance(output, PoolingRequestOutput):  # one output, with no tokens
            timings.first_token = timings.finished = now
            timings.finish_reasons = ["stop"]
            self._report(timings)
            return
        tokens = sum(len(c.token_ids) for c in output.outputs)
        if tokens and timings.first_token is None:
            timings.first_token = now
        if tokens > timings.num_output_tokens:
            if timings.last_token is not None and self.on_token_interval is not None:
                self.on_token_interval(now - timings.last_token)
            timings.last_token = now
        timings.num_output_tokens = tokens
        if output.finished:
            timings.finished = now
            timings.finish_reasons = [c.finish_reason or "abort" for c in output.outputs]
            self._report(timings)

    def _report(self, timings: RequestTimings) -> None:
        if self.on_request_finished is not None:
            self.on_request_finished(timings)

    # ---- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        release_at: float | None = None  # when freed memory goes back; None: it has
        try:
            while not self._stop.is_set():
                self._wakeup.clear()
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    now = time.monotonic()
                    if release_at is not None and now >= release_at:
                        release_free_memory()
                        release_at = None
                    self._wakeup.wait(0.5 if release_at is None else min(0.5, release_at - now))
                    continue
                self._step()
                release_at = time.monotonic() + IDLE_RELEASE_SECONDS
        except Exception as exc:  # the loop itself broke: nothing more can be served
            logger.exception("the engine loop crashed")
            self._failure = f"the engine loop crashed: {exc}"
            self._stop.set()
        self._fail_in_flight(EngineDeadError(self._failure or "the server is shutting down"))
        self._refuse_commands()

    def _refuse_commands(self) -> None:
        """Once the loop has stopped (or is wedged in a step): every queued call gets the
        engine's failure, not a wait forever (/admin/cache, a runtime adapter load)."""
        error = EngineDeadError(self._failure or "the engine loop is not running")
        for kind, payload in self._take_commands():
            if kind == "call":
                _, loop, future = payload  # type: ignore[misc]
                loop.call_soon_threadsafe(_fail_future, future, error)

    def _take_commands(self) -> Iterator[tuple[str, object]]:
        """The commands queued so far, each taken off the queue as it is read."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bad step must not take the server down
            logger.exception("engine step failed; failing the requests in flight")
            self._failed_steps += 1
            if self._failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
                self._failure = f"{self._failed_steps} engine steps failed in a row: {exc}"
                self._stop.set()
            self._fail_in_flight(EngineStepError(f"internal error during generation: {exc}"))
            return
        finally:
            self._step_started = None
        self._failed_steps = 0
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            # One request's own failure (engine.step isolated it) fails that request only.
            stream.put(EngineStepError(f"internal error in this request: {output.error}")
                       if output.error else output)

    def _watch(self) -> None:
        """Declare the engine wedged when one step runs past `step_timeout`: a thread cannot
        be stopped, so in-flight requests fail now and /health answers 503 from then on."""
        while not self._stop.wait(min(1.0, self.step_timeout / 4)):
            started = self._step_started
            if started is not None and time.monotonic() - started > self.step_timeout:
                self._failure = (f"an engine step has run for over {self.step_timeout:g} s; "
                                 "the engine is wedged")
                logger.error(self._failure)
                self._stop.set()
                with self._lock:
                    streams = list(self._streams.values())
                for stream in streams:
                    stream.put(EngineDeadError(self._failure))
                self._refuse_commands()
                return

    def _drain_commands(self) -> None:
        for kind, payload in self._take_commands():
            if kind == "add":
                self._add(payload)  # type: ignore[arg-type]
            elif kind == "call":
                self._call(*payload)  # type: ignore[misc]
            elif payload in self.engine.output_processor.parents:
                self.engine.abort_request(payload)  # type: ignore[arg-type]

    def _call(self, fn: Callable[[LLMEngine], object], loop: asyncio.AbstractEventLoop,
              future: asyncio.Future) -> None:
        try:
            result = fn(self.engine)
        except Exception as exc:
            loop.call_soon_threadsafe(future.set_exception, exc)
        else:
            loop.call_soon_threadsafe(future.set_result, result)

    def _add(self, prepared: PreparedRequest) -> None:
        try:
            stream = self._streams.get(prepared.request_id)
            if stream is None:
                return  # the client left before the engine saw the request
            try:
                self.engine.add_prepared(prepared)
            except ValueError as exc:
                stream.put(exc)
        finally:
            # Only now that the scheduler counts them (a moment counted twice errs safe).
            with self._lock:
                self._queued -= len(prepared.children)

    def _fail_in_flight(self, error: Exception) -> None:
        # Unregistered as they fail, so that an "add" still queued for one of them finds no
        # stream and is dropped, not run for a client that already has its error.
        with self._lock:
            streams = dict(self._streams)
            self._streams.clear()
        try:
            self.engine.abort_request(list(self.engine.output_processor.parents))
        except Exception as exc:  # the engine's own state is broken: stop serving
            logger.exception("could not abort requests after a failed step")
            self._failure = f"engine state is broken: {exc}"
            self._stop.set()
        for stream in streams.values():
            stream.put(error)
