"""`pkv bench serve --url URL`: streaming requests against any OpenAI-compatible server.

Per concurrency level: request/output/total throughput, TTFT, TPOT and inter-token latency
percentiles, and goodput (requests per second meeting the TTFT/TPOT SLOs).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from pkv.cli.http import get_json
from pkv.core.progress import make_progress

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact").split()
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass
class ServeResult:
    """Figures of one concurrency level (times in seconds)."""

    concurrency: int
    duration: float
    records: list[RequestRecord]
    slo_ttft: float | None
    slo_tpot: float | None

    def summary(self) -> dict[str, float | int]:
        ok = [r for r in self.records if r.ok]
        out = sum(r.output_tokens for r in ok)
        total = out + sum(r.prompt_tokens for r in ok)
        s: dict[str, float | int] = {
            "concurrency": self.concurrency, "completed": len(ok),
            "failed": len(self.records) - len(ok), "duration_s": self.duration,
            "request_throughput": len(ok) / self.duration,
            "output_throughput": out / self.duration, "total_throughput": total / self.duration,
        }
        series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.output_tokens > 1],
                  "itl": [g for r in ok for g in r.itl]}
        for name, values in series.items():
            s[f"mean_{name}_ms"] = 1000 * float(np.mean(values)) if values else 0.0
            for p in PERCENTILES:
                s[f"p{p}_{name}_ms"] = 1000 * float(np.percentile(values, p)) if values else 0.0
        good = [r for r in ok if (self.slo_ttft is None or r.ttft <= self.slo_ttft)
                and (self.slo_tpot is None or r.tpot <= self.slo_tpot)]
        s["goodput"] = len(good) / self.duration
        return s


def synthetic_messages(num: int, input_len: int, seed: int) -> list[str]:
    """Prompts of about `input_len` tokens (one common word is about one token)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(input_len)) for _ in range(num)]


def check_server(url: str, headers: dict[str, str]) -> str:
    """Return the served model's id; raise a clear error if the server is not there."""
    return get_json(url, "/v1/models", headers, timeout=10)["data"][0]["id"]


async def _error_message(response: httpx.Response) -> str:
    """The server's own words for a refused request (its error object's message)."""
    text = (await response.aread()).decode(errors="replace")
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> RequestRecord:
    start = time.perf_counter()
    last = start
    record = RequestRecord(ok=False)
    chunks = 0
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {await _error_message(r)}"
                return record
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # the stream ended in an error: not a completed request
                    record.error = str(chunk["error"].get("message") or chunk["error"])
                    return record
                if chunk.get("usage"):
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):
                    now = time.perf_counter()
                    if chunks == 0:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last, chunks = now, chunks + 1
        record.e2e = time.perf_counter() - start
        record.output_tokens = record.output_tokens or chunks
        record.ok = chunks > 0
    except httpx.HTTPError as exc:
        record.error = str(exc) or type(exc).__name__
    return record


async def run_level(url: str, model: str, headers: dict[str, str], prompts: list[str],
                    output_len: int, concurrency: int, request_rate: float,
                    slo_ttft: float | None, slo_tpot: float | None, seed: int) -> ServeResult:
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    records: list[RequestRecord] = []
    with make_progress() as progress:
        task = progress.add_task(f"concurrency {concurrency}", total=len(prompts), info="")
        async with httpx.AsyncClient(headers=headers, timeout=600, limits=limits) as client:
            async def limited(prompt: str) -> None:
                body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                async with semaphore:
                    records.append(await _one(client, url, body))
                progress.advance(task)

            start = time.perf_counter()
            tasks = []
            for prompt in prompts:
                tasks.append(asyncio.create_task(limited(prompt)))
                if request_rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
            await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
    return ServeResult(concurrency, duration, records, slo_ttft, slo_tpot)
