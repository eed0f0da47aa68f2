"""Chat messages as chat templates take them: OpenAI's message dicts checked (a role, text
content, tool calls whose arguments are JSON objects) and put in the form templates read."""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Template variables pkv sets itself: chat_template_kwargs may not.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt",
                                      "continue_final_message", "bos_token", "eos_token",
                                      "chat_template", "tokenize", "raise_exception",
                                      "strftime_now"})


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """A ValueError naming the first variable of `kwargs` that pkv sets itself."""
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r}: pkv sets it")


def message_problem(message: Any) -> str | None:
    """What keeps `message` from being an OpenAI chat message a text model reads (None:
    nothing)."""
    if not isinstance(message, dict):
        return f"a message is a dict with 'role' and 'content', got {type(message).__name__}"
    role = message.get("role")
    if role not in ROLES:
        return f"role must be one of {', '.join(ROLES)}, got {role!r}"
    content = message.get("content")
    if content is None:
        return None if may_omit_content(message) else f"a {role} message needs content (a " \
                                                      "string or a list of text parts), not None"
    if isinstance(content, list):
        if first_non_text_part(content) is None:
            return None
        return "content parts must be text parts ({'type': 'text', 'text': '...'}): pkv " \
               "serves text-only models"
    if not isinstance(content, str):
        return f"content must be a string or a list of text parts, got {type(content).__name__}"
    return None


def may_omit_content(message: dict[str, Any]) -> bool:
    """OpenAI's rule: only an assistant message that calls tools may go without content."""
    return message.get("role") == "assistant" and bool(message.get("tool_calls")
                                                        or message.get("function_call"))


def first_non_text_part(parts: list[Any]) -> int | None:
    """The index of the first content part that is not a text part (pkv serves text: an
    image or audio part dropped in silence would change the question)."""
    for i, part in enumerate(parts):
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            return i
    return None


# One thinking block, three names: templates read any of them (transformers fills all).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message without a problem (see message_problem) as templates read it: text parts
    joined by newlines (vLLM's rule), no null content, no other null field (a replayed
    `"tool_calls": null` broke `'tool_calls' in message` templates; transformers drops them
    too), a thinking block under each of its names, tool-call arguments as objects
    (templates write `arguments | tojson`; OpenAI sends the JSON text)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    out = {key: value for key, value in message.items() if value is not None}
    out["content"] = content or ""
    reasoning = next((out[k] for k in REASONING_FIELDS if isinstance(out.get(k), str)), None)
    if reasoning is not None:
        out.update({k: reasoning for k in REASONING_FIELDS if k not in out})
    if out.get("tool_calls"):
        out["tool_calls"] = [_parsed_arguments(call) for call in out["tool_calls"]]
    return out


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return call  # already an object (offline callers may pass one)
    try:
        parsed = json.loads(arguments)
    except ValueError:
        raise ValueError(f"tool call {function.get('name')!r}: arguments must be a JSON "
                         f"object, got {arguments[:60]!r}") from None
    return {**call, "function": {**function, "arguments": parsed}}
