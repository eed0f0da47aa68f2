"""Mistral format: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the marker is a
special token: text is decoded with special tokens kept)."""

from __future__ import annotations

from pkv.core.structured_output.tool_calls import Extraction, content_before, json_call_list

MARKER = "[TOOL_CALLS]"


class MistralToolParser:
    name = "mistral"
    needs_special_tokens = True

    def extract(self, text: str, final: bool) -> Extraction:
        plain = content_before(text, MARKER, final)
        if plain is not None:
            return plain
        at = text.find(MARKER)
        bracket = text.find("[", at + len(MARKER))
        calls = json_call_list(text, bracket)[0] if bracket >= 0 else []
        if final and not calls:
            return Extraction(text)
        return Extraction(text[:at], calls)
