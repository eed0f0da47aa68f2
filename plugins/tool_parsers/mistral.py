"""Mistral formats (the marker is a special token: text is decoded with special tokens kept):

- `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, a JSON list (tokenizers before v11:
  Mistral 7B v0.3, Mixtral, Nemo);
- `[TOOL_CALLS]name[ARGS]{...}`, once a call (v11 on: Mistral Small 3.2, Devstral, Magistral;
  a `[CALL_ID]id` may sit between the name and `[ARGS]`).
"""

from __future__ import annotations

from pkv.core.structured_output.tool_calls import (Extraction, ToolCall, content_before,
                                                   json_call_list, json_value_end)

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


class MistralToolParser:
    name = "mistral"
    needs_special_tokens = True

    def extract(self, text: str, final: bool) -> Extraction:
        plain = content_before(text, MARKER, final)
        if plain is not None:
            return plain
        at = text.find(MARKER)
        after = text[at + len(MARKER):].lstrip()
        if not after and not final:
            return Extraction(text[:at])  # which format follows is not known yet
        if after.startswith("["):
            calls = json_call_list(text, text.find("[", at + len(MARKER)))[0]
        else:
            calls = _named_calls(text[at:])
        if final and not calls:
            return Extraction(text)
        return Extraction(text[:at], calls)


def _named_calls(text: str) -> list[ToolCall]:
    """The calls of `[TOOL_CALLS]name[ARGS]{...}` runs, the last as far as it has arrived
    (no name until its `[ARGS]` has come)."""
    calls = []
    for segment in text.split(MARKER)[1:]:
        head, found, rest = segment.partition(ARGS)
        if not found:
            calls.append(ToolCall(None))
            break
        name = head.partition(CALL_ID)[0].strip()
        end = json_value_end(rest, 0)
        if end is None:
            calls.append(ToolCall(name, rest.lstrip()))
            break
        calls.append(ToolCall(name, rest[:end].strip(), complete=True))
    return calls
