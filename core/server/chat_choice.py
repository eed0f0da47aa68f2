"""One chat choice's generated text as the parts an OpenAI client reads: reasoning, content
and tool calls, whole (a chat.completion) or as what is new since the last chunk."""

from __future__ import annotations

import json
from typing import Any

from pkv.core.structured_output.reasoning import ReasoningParser
from pkv.core.structured_output.tool_calls import Extractor, ToolCall, ToolCallDeltas, openai_calls


class ChoiceShaper:
    """Splits a choice's text: `reasoning` moves a thinking block out of the content,
    `extract` (a tool parser, or a forced call's reader) takes calls out of the rest."""

    def __init__(self, extract: Extractor | None, reasoning: ReasoningParser | None) -> None:
        self.extract = extract
        self.reasoning = reasoning
        self.calls = ToolCallDeltas(extract) if extract else None
        self.reasoning_sent = 0
        self.content_sent = 0

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        return self.reasoning.split(text, final) if self.reasoning else ("", text)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole assistant message, and the finish reason (`tool_calls` when it calls)."""
        reasoning, rest = self._split(text, True)
        message: dict[str, Any] = {"role": "assistant", "content": rest}
        if self.reasoning:
            message["reasoning_content"] = reasoning or None
        calls = self._final_calls(rest, cut=finish_reason == "length")
        if calls:
            content = self.extract(rest, True).content  # type: ignore[misc]
            message.update(content=content if content.strip() else None,
                           tool_calls=openai_calls(calls))
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return message, finish_reason

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """What is new in this choice: reasoning_content, content, tool_calls."""
        reasoning, rest = self._split(text, final)
        delta: dict[str, Any] = {}
        if len(reasoning) > self.reasoning_sent:
            delta["reasoning_content"] = reasoning[self.reasoning_sent:]
            self.reasoning_sent = len(reasoning)
        if self.calls is not None:
            content, calls = self.calls.advance(rest, final)
            if calls:
                delta["tool_calls"] = calls
        else:
            content = rest[self.content_sent:]
            self.content_sent = max(self.content_sent, len(rest))
        if content:
            delta["content"] = content
        return delta

    @property
    def called(self) -> bool:
        return bool(self.calls and self.calls.call_ids)

    def _final_calls(self, text: str, cut: bool) -> list[ToolCall]:
        """The whole calls of the finished text, if each has a name and a JSON object for
        arguments (else none, and the text stays content); where max_tokens `cut` the text,
        the call it cut off too, its arguments as far as they got, as a stream gives it (and
        OpenAI's API, its finish_reason `length`)."""
        if self.extract is None:
            return []
        found = self.extract(text, True).calls
        last = found[-1:] if cut and found and found[-1].name else []  # (however far it got)
        calls = [c for c in found[:len(found) - len(last)] if c.complete]
        try:
            valid = all(c.name and isinstance(json.loads(c.arguments), dict) for c in calls)
        except ValueError:
            valid = False
        return calls + last if valid else []
