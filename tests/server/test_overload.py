"""A real server with small limits under a crowd: 200 requests at the same moment, a storm
of abandoned streams, bursts then idle. Overload is 503 with Retry-After (never 500), /health
stays quick, and afterwards the canary is the same, every KV block is back, memory too."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from pkv.cli.bench.burst import burst
from pkv.core.engine.async_engine import EngineDeadError, EngineStepError, QueueFullError
from pkv.core.server.errors import engine_error
from pkv.core.structured_output.params import ConstraintCompilerBusyError
from pkv.tests.server.conftest import RunningServer, start_server, stop_server
from pkv.tests.server.test_hardening import _blocks_idle, _canary, _rss_without_kv
from pkv.tests.server.test_http import MODEL

BODY = {"model": MODEL, "prompt": "Write a short poem about the sea.", "max_tokens": 8,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(str(tmp_path_factory.mktemp("overload")), "--max-num-seqs", "16",
                           "--max-waiting-requests", "32", "--kv-cache-memory", "48MiB")
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def canary_text(small_server: RunningServer) -> str:
    return _canary(small_server)


def test_a_burst_of_200_is_served_or_refused_with_retry_after(small_server: RunningServer,
                                                              canary_text: str) -> None:
    result = asyncio.run(burst(small_server.base_url, small_server.headers,
                               [BODY, {**BODY, "stream": True}], 200))
    assert result.problems() == [], (result.problems(), result.statuses)
    assert set(result.statuses) == {200, 503}, result.statuses
    # The queue bound (32 waiting) and the batch (16) let at least one wave through whole.
    assert result.statuses[200] >= 32, result.statuses
    assert '"server_overloaded"' in result.examples[503]
    # /health answered within 2 s at worst. The engine's thread keeps both cores busy through
    # a burst; its kernels run without the GIL, so the event loop answers meanwhile: 25-395 ms
    # on a quiet machine (240-490 ms while they held it), 64-613 ms with a CPU hog beside the
    # server; with the suite's other worker beside it a probe once took ~1.2 s.
    assert result.health_s and result.health_max_ms < 2000, result.health_max_ms
    _blocks_idle(small_server)
    assert _canary(small_server) == canary_text


def test_a_storm_of_abandoned_streams_frees_everything(small_server: RunningServer,
                                                       canary_text: str) -> None:
    body = {"model": MODEL, "prompt": "Tell me a very long story", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    statuses = asyncio.run(_abandon_streams(small_server, body, 50, 0.5))
    # 16 run and 32 wait when the 50 arrive: those are abandoned, the rest refused at once.
    assert statuses.get("abandoned", 0) >= 32 and set(statuses) <= {"abandoned", 503}, statuses
    _blocks_idle(small_server)
    assert _canary(small_server) == canary_text


async def _abandon_streams(server: RunningServer, body: dict, count: int,
                          after: float) -> Counter:
    """`count` streams whose clients leave `after` seconds in: how each one ended."""
    async with httpx.AsyncClient(timeout=60, headers=server.headers,
                                 limits=httpx.Limits(max_connections=count)) as client:
        async def one() -> str | int:
            try:
                async with client.stream("POST", f"{server.base_url}/v1/completions",
                                         json=body) as r:
                    if r.status_code != 200:
                        return r.status_code
                    await asyncio.wait_for(r.aread(), after)
            except asyncio.TimeoutError:
                return "abandoned"
            return "finished"
        return Counter(await asyncio.gather(*(one() for _ in range(count))))


def test_memory_comes_back_after_each_burst(small_server: RunningServer) -> None:
    def one_round() -> float:
        result = asyncio.run(burst(small_server.base_url, small_server.headers,
                                   [{**BODY, "max_tokens": 2}], 32, health_every=0.5))
        assert result.problems() == [], result.problems()
        _blocks_idle(small_server)
        return _rss_without_kv(small_server)

    start = one_round()  # the first round fills what fills once (allocator arenas, shapes)
    after = [one_round() for _ in range(11)]  # a leak of 4.4 MiB a burst shows
    grew = [(rss - start) / 2**20 for rss in after]
    assert max(grew) < 48, grew


@pytest.mark.parametrize("exc, status, retry", [
    (QueueFullError("full"), 503, True), (ConstraintCompilerBusyError("busy"), 503, True),
    (EngineDeadError("the server is shutting down"), 503, True),
    (EngineStepError("step failed"), 500, False), (ValueError("a bug"), None, False),
])
def test_every_engine_failure_has_its_status(exc: Exception, status: int | None,
                                             retry: bool) -> None:
    error = engine_error(exc)
    assert (error.status if error else None) == status
    assert ("Retry-After" in error.headers if error else False) == retry
