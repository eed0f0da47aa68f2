"""`pkv bench burst`: many clients send one request each at the same moment.

An overloaded server must say so (503 or 429 with Retry-After) and never answer 500, and
its /health must stay quick while it sorts the crowd. This sends the burst, probes /health
every few milliseconds meanwhile, and counts every answer by status.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from rich.table import Table

# An overloaded server may answer these; anything else but 200 is a failure of the burst.
OVERLOAD_STATUSES = (429, 503)


@dataclass
class BurstResult:
    """Answers of one burst by status, and /health latencies taken while it ran."""

    statuses: Counter = field(default_factory=Counter)
    without_retry_after: int = 0  # 429/503 answers missing the header
    transport_errors: int = 0  # no HTTP answer at all
    stream_errors: int = 0  # 200 streams that carried an error event instead of tokens
    examples: dict[int, str] = field(default_factory=dict)  # a body per status
    health_s: list[float] = field(default_factory=list)
    health_failures: int = 0  # /health answers that were not 200 (or never came)
    seconds: float = 0.0

    @property
    def health_p99_ms(self) -> float:
        return float(np.percentile(self.health_s, 99)) * 1000 if self.health_s else 0.0

    @property
    def health_max_ms(self) -> float:
        return max(self.health_s, default=0.0) * 1000

    def problems(self) -> list[str]:
        """What an overloaded server must never do (empty: the burst passed)."""
        bad = {s: n for s, n in self.statuses.items() if s not in (200, *OVERLOAD_STATUSES)}
        out = [f"{n} x HTTP {s}: {self.examples[s][:160]}" for s, n in sorted(bad.items())]
        if self.without_retry_after:
            out.append(f"{self.without_retry_after} refusals without Retry-After")
        if self.stream_errors:
            out.append(f"{self.stream_errors} streams answered 200, then an error event")
        if self.transport_errors:
            out.append(f"{self.transport_errors} requests got no HTTP answer")
        if self.health_failures:
            out.append(f"/health failed {self.health_failures} times")
        return out


async def burst(base: str, headers: dict[str, str], bodies: list[dict[str, Any]], clients: int,
                path: str = "/v1/completions", health_every: float = 0.05,
                timeout: float = 300) -> BurstResult:
    """Send `clients` requests at once (client i sends `bodies[i % len(bodies)]`); probe
    /health until the last answer."""
    result = BurstResult()
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        start_gate = asyncio.Event()

        async def one(i: int) -> None:
            await start_gate.wait()
            try:
                r = await client.post(f"{base}{path}", json=bodies[i % len(bodies)])
            except httpx.HTTPError:
                result.transport_errors += 1
                return
            result.statuses[r.status_code] += 1
            result.examples.setdefault(r.status_code, r.text)
            if r.status_code in OVERLOAD_STATUSES and "retry-after" not in r.headers:
                result.without_retry_after += 1
            if r.status_code == 200 and 'data: {"error"' in r.text:
                result.stream_errors += 1
                result.examples.setdefault(-1, r.text[-300:])

        # The probe is its own process: in this one its timings would include the wait for
        # the interpreter behind 200 clients' callbacks, which says nothing of the server.
        context = multiprocessing.get_context("spawn")
        done, times = context.Event(), context.Queue()
        prober = context.Process(target=_probe_health, args=(base, health_every, done, times),
                                 daemon=True)
        prober.start()
        tasks = [asyncio.ensure_future(one(i)) for i in range(clients)]
        await asyncio.sleep(0.5)  # every client waiting at the gate, the probe running
        began = time.monotonic()
        start_gate.set()
        await asyncio.gather(*tasks)
        result.seconds = time.monotonic() - began
        done.set()
        result.health_s, result.health_failures = times.get(timeout=30)
        prober.join(timeout=10)
    return result


def _probe_health(base: str, every: float, done: Any, times: Any) -> None:
    """GET /health every `every` seconds until `done`; put (latencies, failures)."""
    latencies, failures = [], 0
    with httpx.Client(timeout=10) as health:
        while not done.is_set():
            began = time.monotonic()
            try:
                failures += health.get(f"{base}/health").status_code != 200
            except httpx.HTTPError:
                failures += 1
            latencies.append(time.monotonic() - began)
            done.wait(every)
    times.put((latencies, failures))


def burst_table(results: dict[str, BurstResult], title: str) -> Table:
    """One row per burst: answers by status, refusals missing Retry-After, /health times."""
    statuses = sorted({s for r in results.values() for s in r.statuses})
    table = Table(title=title)
    table.add_column("run")
    for s in statuses:
        table.add_column(f"HTTP {s}", justify="right")
    for column in ("200 then error", "no Retry-After", "no answer", "/health p99 ms", "/health max ms",
                   "seconds"):
        table.add_column(column, justify="right")
    for name, r in results.items():
        table.add_row(name, *(str(r.statuses.get(s, 0)) for s in statuses),
                      str(r.stream_errors), str(r.without_retry_after), str(r.transport_errors),
                      f"{r.health_p99_ms:.0f}", f"{r.health_max_ms:.0f}", f"{r.seconds:.1f}")
    return table
