"""Tool calls in generated text: what a tool parser extracts, and the stream of OpenAI deltas.

A parser reads the whole text generated so far and says which part is content and which
calls it holds. Both must only grow as text arrives (a call's `arguments` is the raw JSON
text of its arguments, never re-serialized), so a stream can send exactly what is new and
its deltas reassemble to the answer the same text gives without streaming.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class ToolCall:
    """One call: its function's name (None until known) and its arguments' JSON text so far."""

    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass
class Extraction:
    """Generated text split into the content a user sees and the calls it makes."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser(Protocol):
    """A model family's tool-call format (a plugin: see pkv.plugins.tool_parsers)."""

    name: str

    def extract(self, text: str, final: bool) -> Extraction:
        """Content and calls of `text`; with `final` False, hold back what may still become
        markup (a partial start marker) and mark unfinished calls incomplete."""
        ...


Extractor = Callable[[str, bool], Extraction]


def json_value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value that begins at `text[start]` (after whitespace),
    or None while it is unfinished. Scans strings and nesting; does not validate."""
    i = start
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    if i == len(text):
        return None
    if text[i] not in "{[\"":  # a number, true, false, null: ends at a delimiter
        m = _SCALAR.match(text, i)
        end = m.end() if m else i
        return end if end < len(text) else None
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        ch = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def content_before(text: str, marker: str, final: bool) -> Extraction | None:
    """All content while `marker` (where calls begin) has not appeared, less what may be
    its start; None once it has."""
    if marker in text:
        return None
    return Extraction(text[:len(text) - (0 if final else partial_marker(text, marker))])


# Patterns of the scanners below, compiled once: they run on every streamed chunk.
_SCALAR = re.compile(r"[^,}\]\s]*")
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                        r'\s*:\s*')
_OBJECT_END = re.compile(r"\s*\}")
_SEPARATOR = re.compile(r"\s*,?\s*")


def json_call(text: str, start: int) -> tuple[ToolCall, int] | None:
    """A `{"name": ..., "arguments": {...}}` object at `start`: the call (arguments as raw
    text, as far as they have arrived) and the index past the object (len(text) while
    unfinished); None if the text there is not such an object (yet)."""
    m = _CALL_HEAD.match(text, start)
    if m is None:
        return None
    name = json.loads(f'"{m.group(1)}"')
    args_end = json_value_end(text, m.end())
    if args_end is None:
        return ToolCall(name, text[m.end():].lstrip()), len(text)
    arguments = text[m.end():args_end].strip()
    close = _OBJECT_END.match(text, args_end)
    if close is None:
        return ToolCall(name, arguments), len(text)
    return ToolCall(name, arguments, complete=True), close.end()


def json_call_list(text: str, start: int) -> tuple[list[ToolCall], int]:
    """Calls of a JSON array of call objects at `start`, and where the array ends."""
    calls: list[ToolCall] = []
    i = start + 1  # past "["
    while True:
        i = _SEPARATOR.match(text, i).end()  # type: ignore[union-attr]
        if i >= len(text) or text[i] == "]":
            return calls, min(i + 1, len(text))
        found = json_call(text, i)
        if found is None:
            return calls, len(text)
        call, i = found
        calls.append(call)
        if not call.complete:
            return calls, len(text)


def forced_named(name: str) -> Extractor:
    """The text is the arguments of `name` (tool_choice names a function)."""
    return lambda text, final: Extraction("", [ToolCall(name, text.strip(),
                                                        final and bool(text.strip()))])


def forced_required(text: str, final: bool) -> Extraction:
    """The text is a JSON array of {"name", "parameters"} (tool_choice "required")."""
    start = text.find("[")
    if start < 0:
        return Extraction("")
    return Extraction("", json_call_list(text, start)[0])


class ToolCallDeltas:
    """What is new in a choice's content and calls since the last output: OpenAI stream
    deltas. The first delta of a call carries its index, id, type and name; later ones
    fragments of its arguments."""

    def __init__(self, extract: Extractor) -> None:
        self.extract = extract
        self.content_sent = 0
        self.calls_sent: list[tuple[str, int]] = []  # (id, argument characters sent)

    def advance(self, text: str, final: bool) -> tuple[str, list[dict]]:
        found = self.extract(text, final)
        content = ""
        # Whitespace alone is held back: before a call it is no content at all (as the whole
        # message has it); it goes out once text follows, or at the end without a call.
        if found.content.strip() or (final and not found.calls):
            content = found.content[self.content_sent:]
            self.content_sent = max(self.content_sent, len(found.content))
        deltas = []
        for index, call in enumerate(found.calls):
            if call.name is None:
                break
            # One entry per call in a chunk: a client (the openai SDK's stream helper) makes
            # a second call of a second entry with the same index.
            if index == len(self.calls_sent):
                call_id = new_call_id()
                deltas.append({"index": index, "id": call_id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                self.calls_sent.append((call_id, len(call.arguments)))
                continue
            call_id, sent = self.calls_sent[index]
            if len(call.arguments) > sent:
                deltas.append({"index": index,
                               "function": {"arguments": call.arguments[sent:]}})
                self.calls_sent[index] = (call_id, len(call.arguments))
        return content, deltas

    @property
    def call_ids(self) -> list[str]:
        return [call_id for call_id, _ in self.calls_sent]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_calls(calls: list[ToolCall], ids: list[str] | None = None) -> list[dict]:
    """`message.tool_calls` of an answer."""
    ids = ids or []
    return [{"id": ids[i] if i < len(ids) else new_call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls) if c.name is not None]
