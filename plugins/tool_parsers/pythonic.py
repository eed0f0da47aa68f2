"""Pythonic format (Llama 3.2/4, ToolACE): `[get_weather(city="Paris"), now()]`.

Python call syntax has no prefix that is stable JSON, so calls are sent when the list is
whole; content is held back while the text may still be such a list."""

from __future__ import annotations

import ast
import json

from pkv.core.structured_output.tool_calls import Extraction, ToolCall


class PythonicToolParser:
    name = "pythonic"
    needs_special_tokens = False

    def extract(self, text: str, final: bool) -> Extraction:
        body = text.strip()
        if not body.startswith("[") and (final or body):
            return Extraction(text)
        calls = _calls(body)
        if calls is not None:
            return Extraction("", calls)
        return Extraction(text if final else "")


def _calls(body: str) -> list[ToolCall] | None:
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # (NUL bytes, deep nests)
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None
        try:
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            # (a set, bytes or a complex number is a Python literal but no JSON value)
            arguments = json.dumps(kwargs, ensure_ascii=False)
        except (ValueError, TypeError, RecursionError):
            return None
        calls.append(ToolCall(node.func.id, arguments, complete=True))
    return calls
