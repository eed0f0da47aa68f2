"""`pkv bench tools`: forced tool calls against a real server, each call's arguments
validated against its function's schema (the promise of tool_choice required / named)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pkv.cli.http import get_json

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 24},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "book_table", "description": "Book a restaurant table.",
        "parameters": {"type": "object", "properties": {
            "restaurant": {"type": "string", "maxLength": 24},
            "people": {"type": "integer", "minimum": 1, "maximum": 20},
            "date": {"type": "string", "format": "date"}},
            "required": ["restaurant", "people", "date"]}}},
]
QUESTIONS = ["What's the weather in Paris?", "Book a table for four at Chez Marie tomorrow.",
             "Is it raining in Berlin?", "I need dinner for 2 at Luigi's on 2026-12-24."]


@dataclass
class ToolRun:
    valid: int = 0
    requests: int = 0
    calls: int = 0
    seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


async def forced_calls(base: str, headers: dict[str, str], model: str, count: int,
                       concurrency: int = 8) -> ToolRun:
    """`count` requests, alternately tool_choice required and a named function, sampled
    at temperature 0.8; a request is valid when every call's arguments match its schema."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    run = ToolRun(requests=count)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=300) as client:
        async def one(i: int) -> None:
            choice = "required" if i % 2 == 0 else {
                "type": "function", "function": {"name": TOOLS[i // 2 % 2]["function"]["name"]}}
            body = {"model": model, "tools": TOOLS, "tool_choice": choice, "temperature": 0.8,
                    "seed": i, "max_tokens": 100,
                    "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}
            async with gate:
                began = time.monotonic()
                r = await client.post(f"{base}/v1/chat/completions", json=body)
                run.seconds.append(time.monotonic() - began)
            try:
                calls = r.json()["choices"][0]["message"]["tool_calls"] or []
                for call in calls:
                    jsonschema.validate(json.loads(call["function"]["arguments"]),
                                        schemas[call["function"]["name"]],
                                        format_checker=jsonschema.FormatChecker())
                if not calls:
                    raise ValueError("no tool call")
                run.valid += 1
                run.calls += len(calls)
            except Exception as exc:  # a failed request is counted and described, not raised
                run.failures.append(f"{type(exc).__name__}: {str(exc)[:120]} ({r.text[:200]})")

        await asyncio.gather(*(one(i) for i in range(count)))
    return run


def first_model(base: str, headers: dict[str, str]) -> Any:
    return get_json(base, "/v1/models", headers)["data"][0]["id"]
