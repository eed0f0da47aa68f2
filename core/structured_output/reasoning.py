"""Reasoning output: a model's `<think>…</think>` block moved out of the answer's content
into `reasoning_content`. Both parts only grow as text arrives, so streams send what is new."""

from __future__ import annotations

from dataclasses import dataclass

from pkv.core.structured_output.tool_calls import partial_marker

START, END = "<think>", "</think>"

# Thinking tokens each `reasoning_effort` allows (OpenAI names the efforts, not their sizes;
# "max" sets no cap).
EFFORT_BUDGETS = {"none": 0, "minimal": 128, "low": 512, "medium": 2048, "high": 8192,
                  "xhigh": 32768}


@dataclass(frozen=True)
class ReasoningParser:
    """`implicit_start`: the chat template already opened the block (DeepSeek-R1), so the
    output is reasoning until END even without START; otherwise (Qwen3) only an output that
    begins with START reasons."""

    name: str
    implicit_start: bool

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text generated so far."""
        body = text.lstrip()
        opened = body.startswith(START)
        if not opened and not final and START.startswith(body):
            return "", ""  # the block may be opening
        if not opened and not self.implicit_start:
            return "", text
        body = body[len(START):] if opened else text
        end = body.find(END)
        if end < 0:
            held = 0 if final else partial_marker(body, END)
            return body[:len(body) - held].lstrip(), ""
        return body[:end].lstrip(), body[end + len(END):].lstrip()


REASONING_PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True),
                     "qwen3": ReasoningParser("qwen3", implicit_start=False)}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser called `name` (None: none); ValueError naming the choices."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from "
                         f"{', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
