"""Hermes format (Qwen 2.5/3, SmolLM3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

import json

from pkv.core.structured_output.tool_calls import Extraction, ToolCall, content_before, json_call

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser:
    name = "hermes"
    needs_special_tokens = False

    def extract(self, text: str, final: bool) -> Extraction:
        plain = content_before(text, START, final)
        if plain is not None:
            return plain
        first = text.find(START)
        calls: list[ToolCall] = []
        at = first
        while at >= 0:
            body = at + len(START)
            end = text.find(END, body)
            call = _call(text[body:end] if end >= 0 else text[body:], final or end >= 0)
            if call is None:
                break
            calls.append(call)
            if end < 0 or not call.complete:
                break
            at = text.find(START, end + len(END))
        if final and not calls:
            return Extraction(text)  # markup without a readable call: it was content
        return Extraction(text[:first], calls)


def _call(body: str, closed: bool) -> ToolCall | None:
    found = json_call(body, len(body) - len(body.lstrip()))
    if found is not None:
        return found[0]
    if not closed:
        return None  # the name has not arrived yet
    try:  # keys in another order: read it whole
        obj = json.loads(body)
        return ToolCall(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False),
                        complete=True)
    except (ValueError, KeyError, TypeError):
        return None
