"""`pkv bench soak`: a real `pkv serve` held at capacity for minutes with hostile traffic.

Clients keep the server saturated (twice its running batch) with a mix of its four
generating APIs, streamed and not: completions and chat (n=2, logprobs, stop strings, three
JSON schemas), Responses (a function tool, a JSON schema, turns continuing stored
responses, responses not stored) and Anthropic Messages (a system prompt, a tool, stop
sequences); 10% of streams are abandoned part way, 5% of requests are invalid on purpose
(half of them a valid body with one field of the wrong kind: any answer but a 5xx).
After every interval (a minute) the clients pause until the server idles, and its memory is
sampled: the curve's plateau, slope and peak decide (cli/bench/soak_memory.py). The run fails
on any error that was not asked for, a KV block still held, memory that keeps climbing, or
open files that grew.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import psutil
from rich.table import Table

from pkv.cli.bench.mutate import WRONG_KINDS, mutated, places
from pkv.cli.bench.serve import WORDS
from pkv.cli.bench.soak_memory import MemoryCurve
from pkv.cli.http import get_metrics

# Bad requests by path, each answered 400 (404: an unknown stored response) naming the field.
INVALID_BODIES: dict[str, list[dict[str, Any]]] = {
    "/v1/completions": [
        {"prompt": "x", "max_tokens": -1}, {"prompt": "x", "temperature": "hot"},
        {"prompt": []}, {"prompt": "x", "top_p": 7},
        {"prompt": "x", "logit_bias": {"999999999": 1}}, {"prompt": "x", "n": 10**6},
        {"prompt": "x", "stop": [""]}],
    "/v1/responses": [
        {"input": []}, {"input": "x", "max_output_tokens": -1},
        {"input": "x", "tool_choice": "required"},
        {"input": "x", "previous_response_id": "resp_none_such"}],
    "/v1/messages": [
        {"max_tokens": 4, "messages": []},
        {"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]},
        {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "top_p": 7}],
}

# One function tool, in the Responses and the Messages shapes.
_WEATHER = {"name": "get_weather", "description": "The weather in a city now.",
            "schema": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}
RESPONSES_TOOL = {"type": "function", "name": _WEATHER["name"],
                  "description": _WEATHER["description"], "parameters": _WEATHER["schema"]}
MESSAGES_TOOL = {"name": _WEATHER["name"], "description": _WEATHER["description"],
                 "input_schema": _WEATHER["schema"]}
CONTINUABLE_TOKENS = 48  # stored responses up to this long are continued (a turn's context)


@dataclass
class Minute:
    served: int = 0
    aborted: int = 0
    invalid: int = 0
    unexpected: list[str] = field(default_factory=list)  # non-deliberate errors
    ttfts: list[float] = field(default_factory=list)

    @property
    def p99_ttft_ms(self) -> float:
        return float(np.percentile(self.ttfts, 99)) * 1000 if self.ttfts else 0.0


@dataclass
class Snapshot:
    rss_bytes: int
    open_files: int
    kv_blocks_free: float
    kv_blocks_total: float
    running: float
    kv_resident_bytes: float  # the KV pool's touched part of the RSS

    @property
    def rss_without_kv(self) -> float:
        return self.rss_bytes - self.kv_resident_bytes


def snapshot(base: str, headers: dict[str, str], pid: int) -> Snapshot:
    values = get_metrics(base, headers)
    process = psutil.Process(pid)
    return Snapshot(process.memory_info().rss, process.num_fds(), values["pkv:kv_blocks_free"],
                    values["pkv:kv_blocks_total"], values["pkv:num_requests_running"],
                    values["pkv:kv_cache_resident_bytes"])


def wait_idle(base: str, headers: dict[str, str], pid: int, timeout: float = 60) -> Snapshot:
    """The server's state once idle (nothing running, every block free) and past the moment
    its engine hands freed memory back."""
    from pkv.core.engine.async_engine import IDLE_RELEASE_SECONDS

    deadline = time.monotonic() + timeout
    while True:
        snap = snapshot(base, headers, pid)
        if snap.running == 0 and snap.kv_blocks_free == snap.kv_blocks_total:
            time.sleep(IDLE_RELEASE_SECONDS + 0.25)
            return snapshot(base, headers, pid)
        if time.monotonic() > deadline:
            return snap
        time.sleep(0.5)


# Three fixed schemas: their compiled grammars are cached once, as a real tenant's would be.
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0,
                                              "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 3,
                                               "items": {"type": "string", "maxLength": 12}}},
     "required": ["tags"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "level": {"enum": ["low", "mid", "high"]}},
     "required": ["ok", "level"]},
]


def request_body(rng: random.Random, stored: list[str] | None = None
                 ) -> tuple[str, dict[str, Any]]:
    """One request of the mix: completions or chat (30% each), Responses or Messages (20%
    each), streamed (70%) or not. `stored`: ids of stored responses a turn may continue."""
    words = rng.randint(8, 48)
    body: dict[str, Any] = {"temperature": rng.choice([0, 0.7]), "stream": rng.random() < 0.7}
    api = rng.random()
    if api < 0.2:
        return "/v1/responses", responses_body(rng, body, words, stored or [])
    if api < 0.4:
        return "/v1/messages", messages_body(rng, body, words)
    body["max_tokens"] = rng.randint(16, 96)
    prompt = _prompt(rng, words)
    extra = rng.random()
    chat = rng.random() < 0.5 or extra >= 0.9
    if extra < 0.1:
        body["n"] = 2
    elif extra < 0.2:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    elif extra < 0.3:
        body["stop"] = [rng.choice(WORDS)]
    elif extra >= 0.9:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": rng.choice(SCHEMAS)}}
    if chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user",
                                                              "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def responses_body(rng: random.Random, body: dict[str, Any], words: int,
                   stored: list[str]) -> dict[str, Any]:
    """A Responses request: 15% with the function tool (a sixth of them forcing a call), 15%
    a JSON schema, 15% continuing a recent stored response (a short turn), 10% not stored,
    20% with instructions."""
    extra = rng.random()
    body["max_output_tokens"] = rng.randint(16, 96)
    if extra < 0.15:
        body.update(tools=[RESPONSES_TOOL], tool_choice="required" if extra < 0.025 else "auto")
    elif extra < 0.3:
        body["text"] = {"format": {"type": "json_schema", "name": "answer",
                                   "schema": rng.choice(SCHEMAS)}}
    elif extra < 0.45 and stored:
        body["previous_response_id"] = rng.choice(stored[-8:])
        body["max_output_tokens"], words = rng.randint(8, 32), min(words, 16)
    elif extra < 0.55:
        body["store"] = False
    if rng.random() < 0.2:
        body["instructions"] = "Answer in one short paragraph."
    return {**body, "input": _prompt(rng, words)}


def messages_body(rng: random.Random, body: dict[str, Any], words: int) -> dict[str, Any]:
    """An Anthropic Messages request: 15% with the tool, 15% stop sequences, 20% a system
    prompt."""
    extra = rng.random()
    body["max_tokens"] = rng.randint(16, 96)
    if extra < 0.15:
        body["tools"] = [MESSAGES_TOOL]
    elif extra < 0.3:
        body["stop_sequences"] = [rng.choice(WORDS)]
    if rng.random() < 0.2:
        body["system"] = "You are terse."
    return {**body, "messages": [{"role": "user", "content": _prompt(rng, words)}]}


def continuable(path: str, body: dict[str, Any]) -> bool:
    """Whether a Responses turn, once answered, may be continued: stored, not itself a
    continuation (chains stay one turn deep), short."""
    return (path == "/v1/responses" and body.get("store", True)
            and "previous_response_id" not in body
            and body["max_output_tokens"] <= CONTINUABLE_TOKENS)


async def _one(client: httpx.AsyncClient, base: str, rng: random.Random, minute: Minute,
               stored: list[str]) -> None:
    path, body = request_body(rng, stored)
    kind = rng.random()
    if kind < 0.025:
        bad_path = rng.choice(list(INVALID_BODIES))
        r = await client.post(f"{base}{bad_path}", json=rng.choice(INVALID_BODIES[bad_path]))
        if r.status_code in (400, 404) and r.json().get("error", {}).get("param"):
            minute.invalid += 1
        else:
            minute.unexpected.append(f"invalid request to {bad_path} answered "
                                     f"{r.status_code}: {r.text[:120]}")
        return
    if kind < 0.05:  # a field of the wrong kind: any answer but a server error
        where = rng.choice(list(places(body)))
        try:
            r = await client.post(f"{base}{path}",
                                  json=mutated(body, where, rng.choice(WRONG_KINDS)))
        except httpx.HTTPError as exc:
            minute.unexpected.append(f"{path} with {where} changed: {type(exc).__name__}")
            return
        if r.status_code >= 500 or (r.status_code >= 400 and not _is_error_body(r)):
            minute.unexpected.append(f"{path} with {where} changed answered {r.status_code}: "
                                     f"{r.text[:120]}")
        minute.invalid += 1
        return
    start = time.monotonic()
    try:
        if not body["stream"]:
            r = await client.post(f"{base}{path}", json=body)
            if r.status_code != 200:
                minute.unexpected.append(f"{path} {r.status_code}: {r.text[:120]}")
                return
            if continuable(path, body):
                stored.append(r.json()["id"])
                del stored[:-32]
            minute.served += 1  # no first token to time: the answer comes whole
            return
        first = await _stream(client, f"{base}{path}", body, minute, start,
                              rng.uniform(0.05, 1.0) if kind < 0.15 else None)
    except httpx.HTTPError as exc:
        minute.unexpected.append(f"{type(exc).__name__}: {exc}")
        return
    if first is not None:
        minute.ttfts.append(first)
        minute.served += 1


def _is_error_body(r: httpx.Response) -> bool:
    """Whether a refusal's body is an error object (OpenAI's, or Anthropic's)."""
    try:
        return isinstance(r.json().get("error"), dict)
    except ValueError:
        return False


def _event(line: str) -> dict[str, Any] | None:
    """A server-sent `data: ` line's JSON (None: OpenAI's closing [DONE])."""
    payload = line.removeprefix("data: ")
    return None if payload == "[DONE]" else json.loads(payload)


def is_error_event(line: str) -> bool:
    """Whether a server-sent `data: ` line is an error event: its own `error` key (OpenAI's
    chunks, Anthropic's `error` event) or an event typed as one (Responses' `error`,
    `response.failed`), not a chunk whose text or logprobs hold the token "error" (the
    hour-long soak met two)."""
    data = _event(line)
    return data is not None and ("error" in data
                                 or data.get("type") in ("error", "response.failed"))


def is_token_event(line: str) -> bool:
    """Whether a `data: ` line carries generated text: an OpenAI chunk with content, a
    tool call or text (not the role-only chunk a chat stream opens with before any token),
    a typed event's deltas (Responses' `*.delta`, Anthropic's `content_block_delta`), not
    the events that open a response or a block."""
    data = _event(line)
    if data is None:
        return False
    kind = data.get("type")
    if kind is None:
        return any(choice.get("text") or (choice.get("delta") or {}).get("content")
                   or (choice.get("delta") or {}).get("tool_calls")
                   for choice in data.get("choices") or [])
    return kind.endswith(".delta") or kind == "content_block_delta"


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], minute: Minute,
                  start: float, abandon_after: float | None) -> float | None:
    """Read a stream to its end (or abandon it); the time to its first chunk."""
    first = None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            minute.unexpected.append(f"{r.status_code}: {text[:120]}")
            return None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if is_error_event(line):
                minute.unexpected.append(f"stream error: {line[:160]}")
                return None
            if first is None and is_token_event(line):
                first = time.monotonic() - start
            if abandon_after is not None and time.monotonic() - start > abandon_after:
                minute.aborted += 1  # leaving the stream drops the connection
                return None
    return first


async def drive(base: str, headers: dict[str, str], concurrency: int, duration: float,
                seed: int) -> Minute:
    """Keep `concurrency` requests in flight for `duration` seconds."""
    minute = Minute()
    rng = random.Random(seed)
    start = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency + 4)
    stored: list[str] = []  # recent stored responses' ids, for turns that continue one
    async with httpx.AsyncClient(headers=headers, timeout=120, limits=limits) as client:
        async def worker() -> None:
            while time.monotonic() - start < duration:
                await _one(client, base, rng, minute, stored)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return minute


def memory_report(base: str, headers: dict[str, str]) -> dict[str, Any]:
    """The server's /admin/memory: caches with their bounds, Python heap growth if traced."""
    return httpx.get(f"{base}/admin/memory", headers=headers, timeout=60).json()


def caches_table(first: dict[str, Any], last: dict[str, Any]) -> Table:
    """Each cache at the first and the last sample, and its bound."""
    table = Table(title="caches (server idle): first sample, last sample, bound")
    for column in ("cache", "first", "last", "bound", "unit"):
        table.add_column(column, justify="left" if column == "cache" else "right")

    def fmt(value: float | None, unit: str) -> str:
        if value is None:
            return "-"
        return f"{value / 2**20:.1f} Mi" if unit == "bytes" else f"{value:.0f}"

    for name, cache in last["caches"].items():
        before = first["caches"].get(name, {}).get("size")
        table.add_row(name, fmt(before, cache["unit"]), fmt(cache["size"], cache["unit"]),
                      fmt(cache["bound"], cache["unit"]) if cache["bound"] is not None
                      else "explicit loads", cache["unit"])
    return table


def memory_table(reports: list[dict[str, Any]]) -> Table:
    """Where the memory outside the KV pool sits at each idle sample (the first: before the
    sampled load): anonymous and file-backed (library code paged in), glibc's heap in use and
    freed-but-held, its mapped blocks, the Python heap when traced, and the OS threads (each
    may own an arena)."""
    table = Table(title="memory at idle, MiB: what the native heap holds")
    for column in ("sample", "RSS - KV", "anon - KV", "file-backed", "malloc in use",
                   "malloc free held", "malloc mmap", "python heap", "threads"):
        table.add_column(column, justify="right")

    def mib(value: float | None) -> str:
        return "-" if value is None else f"{value / 2**20:.0f}"

    for i, r in enumerate(reports):
        heap, resident = r.get("native_heap") or {}, r.get("resident") or {}
        anon = resident.get("anon_bytes")
        table.add_row("before" if i == 0 else str(i),
                      mib(r["rss_bytes"] - r["kv_resident_bytes"]),
                      mib(None if anon is None else anon - r["kv_resident_bytes"]),
                      mib(resident.get("file_bytes")), mib(heap.get("in_use_bytes")),
                      mib(heap.get("free_bytes")), mib(heap.get("mmap_bytes")),
                      mib(r.get("python_heap_bytes")), str(r.get("threads", "-")))
    return table


def minutes_table(minutes: list[Minute], title: str) -> Table:
    table = Table(title=title)
    for column in ("minute", "served", "aborted (10%)", "invalid (5%)", "unexpected errors",
                   "p99 TTFT ms"):
        table.add_column(column, justify="right")
    for i, m in enumerate(minutes, 1):
        table.add_row(str(i), str(m.served), str(m.aborted), str(m.invalid),
                      str(len(m.unexpected)), f"{m.p99_ttft_ms:.0f}")
    return table


def state_table(start: Snapshot, end: Snapshot) -> Table:
    table = Table(title="server state, idle, before and after")
    for column in ("", "RSS MiB", "of it KV pool MiB", "RSS - KV MiB", "open files",
                   "KV blocks free"):
        table.add_column(column, justify="right")
    for name, s in (("start", start), ("end", end)):
        table.add_row(name, f"{s.rss_bytes / 2**20:.0f}", f"{s.kv_resident_bytes / 2**20:.0f}",
                      f"{s.rss_without_kv / 2**20:.0f}", str(s.open_files),
                      f"{s.kv_blocks_free:.0f} / {s.kv_blocks_total:.0f}")
    return table


def verdict(minutes: list[Minute], start: Snapshot, end: Snapshot, curve: MemoryCurve,
            max_slope: float, max_peak: float | None,
            max_warmup: float | None = None, max_ttft_growth: float = 2.0) -> list[str]:
    """What went wrong (empty: the soak passed)."""
    problems = []
    unexpected = [e for m in minutes for e in m.unexpected]
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected errors, e.g. {unexpected[0]}")
    if end.kv_blocks_free != end.kv_blocks_total or end.running:
        problems.append(f"KV blocks still held: {end.kv_blocks_total - end.kv_blocks_free:.0f}")
    problems.extend(curve.problems(max_slope, max_peak, max_warmup))
    if end.open_files > start.open_files + 8:
        problems.append(f"open files grew {start.open_files} -> {end.open_files}")
    timed = [m for m in minutes if m.ttfts]
    if len(timed) > 2 and timed[-1].p99_ttft_ms > max_ttft_growth * timed[0].p99_ttft_ms:
        problems.append(f"p99 TTFT drifted up: last minute over {max_ttft_growth:g}x the first")
    return problems
