"""Llama 3.x JSON format: `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `;`."""

from __future__ import annotations

import re

from pkv.core.structured_output.tool_calls import Extraction, ToolCall, json_call

TAG = "<|python_tag|>"


class Llama3JsonToolParser:
    name = "llama3_json"
    needs_special_tokens = False

    def extract(self, text: str, final: bool) -> Extraction:
        body = text.removeprefix(TAG) if text.startswith(TAG) else text
        start = len(body) - len(body.lstrip())
        if not final and (not body.strip() or TAG.startswith(text)):
            return Extraction("")  # a call may be starting
        if not body[start:].startswith("{"):
            return Extraction(text)
        calls: list[ToolCall] = []
        i = start
        while i < len(body):
            found = json_call(body, i)
            if found is None:
                break
            call, i = found
            calls.append(call)
            sep = re.compile(r"\s*;\s*").match(body, i)
            if not call.complete or sep is None:
                break
            i = sep.end()
        if final and not calls:
            return Extraction(text)
        return Extraction("", calls)
