"""Mistral format: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the marker is a
special token: text is decoded with special tokens kept)."""

from __future__ import annotations

from pkv.core.tool_calls import Extraction, json_call_list, partial_marker

MARKER = "[TOOL_CALLS]"


class MistralToolParser:
    name = "mistral"
    needs_special_tokens = True

    def extract(self, text: str, final: bool) -> Extraction:
        at = text.find(MARKER)
        if at < 0:
            held = 0 if final else partial_marker(text, MARKER)
            return Extraction(text[:len(text) - held])
        bracket = text.find("[", at + len(MARKER))
        calls = json_call_list(text, bracket)[0] if bracket >= 0 else []
        if final and not calls:
            return Extraction(text)
        return Extraction(text[:at], calls)
