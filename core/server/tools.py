"""Tool calling on /v1/chat/completions: checking `tools` and `tool_choice`, rendering them
into the prompt, and how calls are read back out of the generated text.

`auto` lets the model write whatever it likes and a tool parser reads its calls. `required`
and a named function are enforced by structured decoding: the output is then JSON (the named
function's arguments, or an array of {"name", "parameters"}) that matches the schemas, so
even a small model's forced calls validate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from pkv.core.server.errors import OpenAIError
from pkv.core.server.protocol import ChatCompletionRequest, ChatMessage, Tool
from pkv.core.structured_output.params import check_json_schema
from pkv.core.structured_output.tool_calls import (Extraction, Extractor, ToolParser,
                                                   forced_named, forced_required)

MAX_TOOLS = 128  # OpenAI's own bound


@dataclass
class ToolPlan:
    """What one request does with its tools."""

    tools: list[dict[str, Any]]  # passed to the chat template as `tools`
    extractor: Extractor | None  # reads calls from a choice's text (None: no calls)
    schema: dict[str, Any] | None = None  # the grammar of forced calls
    skip_special_tokens: bool = True


def json_object(text: Any) -> bool:
    """Whether `text` is a string holding a JSON object (a tool call's arguments)."""
    try:
        return isinstance(text, str) and isinstance(json.loads(text), dict)
    except ValueError:
        return False


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """400s for tool results without their call's id and calls without JSON arguments."""
    for i, m in enumerate(messages):
        extra = m.model_extra or {}
        if m.role == "tool" and not isinstance(extra.get("tool_call_id"), str):
            raise OpenAIError(400, f"messages[{i}]: a tool message needs the tool_call_id of "
                              "the call it answers", f"messages[{i}].tool_call_id")
        calls = extra.get("tool_calls")
        if m.role != "assistant" or calls is None:
            continue
        try:
            ok = isinstance(calls, list) and all(
                isinstance(c["function"]["name"], str)
                and json_object(c["function"]["arguments"]) for c in calls)
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise OpenAIError(400, f"messages[{i}]: each tool call needs function.name and "
                              "function.arguments, a JSON object as a string",
                              f"messages[{i}].tool_calls")


def plan_tools(body: ChatCompletionRequest, parser: ToolParser | None) -> ToolPlan:
    """Check `tools` and `tool_choice` (400s naming them) and decide how calls are made."""
    tools = body.tools or []
    choice = body.tool_choice or ("auto" if tools else "none")
    _check_tools(tools)
    if choice != "none" and choice != "auto" and not tools:
        raise OpenAIError(400, "tool_choice requires tools", "tool_choice")
    named = {t.function.name: t for t in tools}
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none" or not tools:
        return ToolPlan(template_tools, None)
    if choice == "auto":
        extract = parser.extract if parser else None
        if extract is not None and not body.parallel_tool_calls:
            extract = first_call_only(extract)
        return ToolPlan(template_tools, extract,
                        skip_special_tokens=not getattr(parser, "needs_special_tokens", False))
    if body.constraint_fields():
        raise OpenAIError(400, "a forced tool call (tool_choice required or a named function) "
                          "cannot also follow response_format or another structured-output "
                          "constraint", "tools")
    if choice == "required":
        return ToolPlan(template_tools, forced_required,
                        schema=_calls_schema(tools, body.parallel_tool_calls))
    name = choice.function.name  # type: ignore[union-attr]
    if name not in named:
        raise OpenAIError(400, f"tool_choice names {name!r}, which is not among the tools",
                          "tool_choice")
    return ToolPlan(template_tools, forced_named(name), schema=_parameters(named[name]))


def first_call_only(extract: Extractor) -> Extractor:
    """`parallel_tool_calls: false` under `auto`: the model's first call, the others
    dropped (as vLLM does: nothing in free text can stop a model writing two)."""
    def first(text: str, final: bool) -> Extraction:
        found = extract(text, final)
        return replace(found, calls=found.calls[:1])
    return first


def _check_tools(tools: list[Tool]) -> None:
    if len(tools) > MAX_TOOLS:
        raise OpenAIError(400, f"at most {MAX_TOOLS} tools", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise OpenAIError(400, f"tools[{i}]: the function name {name!r} is used twice",
                              "tools")
        seen.add(name)
        try:
            check_json_schema(_parameters(tool))
        except ValueError as exc:
            raise OpenAIError(400, f"tools[{i}] ({name}): parameters: "
                              f"{str(exc).removeprefix('structured outputs: ')}",
                              "tools") from None


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each a known name with arguments matching its schema. Each
    tool's parameters sit in the array's `$defs` (their own definitions beside them, renamed
    apart), so that their `$ref`s still point where they did."""
    defs: dict[str, Any] = {}
    call = [{"type": "object", "properties": {"name": {"enum": [t.function.name]},
                                              "parameters": _lifted(_parameters(t), f"tool{i}",
                                                                    defs)},
             "required": ["name", "parameters"]} for i, t in enumerate(tools)]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
            "items": call[0] if len(call) == 1 else {"anyOf": call},
            **({"$defs": defs} if defs else {})}


def _lifted(schema: dict[str, Any], name: str, defs: dict[str, Any]) -> dict[str, Any]:
    """`schema` as it goes into a larger one: as it is without references; else a reference
    to `defs[name]`, its definitions (`$defs`, `definitions`) beside it as `{name}_X`, every
    `$ref` in it rewritten to match."""
    if '"$ref"' not in json.dumps(schema):
        return schema

    def moved(ref: str) -> str:
        for key in ("/$defs/", "/definitions/"):
            if ref.startswith("#" + key):
                return f"#/$defs/{name}_{ref[len(key) + 1:]}"
        return f"#/$defs/{name}{ref[1:]}" if ref.startswith("#") else ref

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: moved(v) if k == "$ref" and isinstance(v, str) else rewrite(v)
                    for k, v in node.items()}
        return [rewrite(v) for v in node] if isinstance(node, list) else node

    body = rewrite(schema)
    for key in ("$defs", "definitions"):
        for def_name, definition in (body.pop(key, None) or {}).items():
            defs[f"{name}_{def_name}"] = definition
    defs[name] = body
    return {"$ref": f"#/$defs/{name}"}


def template_knows_tools(template: str) -> bool:
    """Whether a chat template renders `tools` itself (HF templates name the variable)."""
    return "tools" in template


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                      template: str) -> list[dict[str, Any]]:
    """Messages for a chat template. A template that knows tools gets them as they are
    (with `tools=`); for one that does not, the tools go into the system message and past
    calls and results are written in the hermes format they are asked to use."""
    if not tools or template_knows_tools(template):
        return messages
    out = [dict(m) for m in messages]
    for m in out:
        if m.get("tool_calls"):
            m["content"] = (m["content"] + "\n" if m["content"] else "") + "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                              "arguments": c["function"]["arguments"]})
                + "\n</tool_call>" for c in m.pop("tool_calls"))
        elif m["role"] == "tool":
            m["role"], m["content"] = "user", f"<tool_response>\n{m['content']}\n</tool_response>"
    block = _tools_system_block(tools)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{block}"
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def _tools_system_block(tools: list[dict[str, Any]]) -> str:
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions to help with the user's request. Their signatures, "
            f"one JSON object per line:\n<tools>\n{signatures}\n</tools>\n\nTo call one, "
            "answer with a JSON object of its name and arguments inside tags:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n'
            "</tool_call>")
