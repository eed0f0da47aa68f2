"""The Responses API's shapes on the chat machinery: the request body, its `input` items as
chat messages (consecutive function calls one assistant turn), the chat completion request
that asks the same, and an assistant message as output items (`reasoning`, `message`,
`function_call`)."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import Field, field_validator

from pkv.core.engine.outputs import RequestOutput
from pkv.core.server.errors import OpenAIError
from pkv.core.server.protocol import ChatCompletionRequest, RequestBody
from pkv.core.server.serving_chat import chat_request_from
from pkv.core.server.tools import json_object


class ResponsesRequest(RequestBody):
    """The body of POST /v1/responses (fields pkv does not use are accepted and ignored, but
    those whose meaning it does not serve are refused: `check_supported`)."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)  # OpenAI's limits
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    # Named only to be refused: ignoring them would answer another question.
    conversation: Any = None
    prompt: Any = None

    @field_validator("metadata")
    @classmethod
    def _metadata_fits(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (metadata or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise ValueError(f"key {key[:64]!r}: keys hold at most 64 characters and "
                                 "values 512")
        return metadata

    def check_supported(self) -> None:
        """A 400 for a field that asks what pkv does not serve."""
        if self.conversation is not None:
            raise OpenAIError(400, "conversation: pkv has no Conversations API; continue a "
                              "stored response with previous_response_id", "conversation")
        if self.prompt is not None:
            raise OpenAIError(400, "prompt: stored prompt templates are not served; send "
                              "instructions and input", "prompt")

    @property
    def logprobs(self) -> bool:
        """Whether output_text parts carry their tokens' logprobs: asked for by `include`, or
        by asking for alternatives."""
        return LOGPROBS in (self.include or []) or bool(self.top_logprobs)


LOGPROBS = "message.output_text.logprobs"
# What OpenAI's `include` may name; pkv fills the logprobs, the rest concern tools and
# encrypted reasoning pkv does not serve (the Agents SDK sends reasoning.encrypted_content).
INCLUDABLE = frozenset({LOGPROBS, "reasoning.encrypted_content", "file_search_call.results",
                        "web_search_call.results", "web_search_call.action.sources",
                        "message.input_image.image_url", "computer_call_output.output.image_url",
                        "code_interpreter_call.outputs"})


def check_include(include: list[str] | None) -> None:
    """A 400 naming the first `include` value OpenAI does not know."""
    for i, value in enumerate(include or []):
        if value not in INCLUDABLE:
            raise OpenAIError(400, f"include[{i}]: unknown value {value!r} (pkv fills "
                              f"{LOGPROBS!r})", f"include[{i}]")


def _item_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(400, f"{where}: content must be a string or a list of parts", where)
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in (
                "input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise OpenAIError(400, f"{where}[{i}]: expected an input_text part", f"{where}[{i}]")
    return "\n".join(part["text"] for part in content)  # as chat joins text parts


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: consecutive function calls become one assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in ("user", "assistant", "system",
                                                        "developer"):
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role,
                             "content": _item_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call" and all(isinstance(item.get(k), str)
                                             for k in ("call_id", "name", "arguments")):
            if not json_object(item["arguments"]):
                raise OpenAIError(400, f"{where}.arguments: a JSON object as a string",
                                  f"{where}.arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            output = item.get("output")
            if isinstance(output, list):  # input_text parts (the newer form): their text
                output = _item_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str)
                             else json.dumps(output)})
        elif kind == "reasoning":
            continue  # earlier thinking is not shown to the model again
        else:
            raise OpenAIError(400, f"{where}: expected a message, function_call or "
                              "function_call_output item", where)
    return messages


# Chat fields by the Responses field that gave them (errors name what the client sent).
CHAT_TO_RESPONSES = {"max_tokens": "max_output_tokens", "response_format": "text",
                      "reasoning_effort": "reasoning.effort", "messages": "input"}
# A chat tool's field in an error's param (a Responses tool holds it at tools[i].field).
_TOOL_FIELD = re.compile(r"tools\.(\d+)\.function\.(\w+)")


def check_call_outputs(items: str | list[dict[str, Any]], history: list[dict[str, Any]]
                       ) -> None:
    """A 400 naming the first `function_call_output` that answers no earlier call (in the
    input before it, or in the stored turns it continues), as OpenAI refuses it."""
    if isinstance(items, str):
        return
    calls = {call["id"] for m in history for call in m.get("tool_calls") or []}
    for i, item in enumerate(items):
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            continue  # input_messages refuses the item by name
        if item.get("type") == "function_call":
            calls.add(call_id)
        elif item.get("type") == "function_call_output" and call_id not in calls:
            raise OpenAIError(400, f"input[{i}]: no function_call with call_id "
                              f"{call_id!r} comes before this output", f"input[{i}]")


def _text_format(text: dict[str, Any] | None) -> dict[str, Any]:
    """`text.format`, checked: a format a client misspells must not be dropped in silence
    (the answer would come unconstrained)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                            "json_schema"):
        raise OpenAIError(400, 'text.format: expected {"type": "text"}, {"type": '
                          '"json_object"} or {"type": "json_schema", "name": ..., "schema": '
                          '{...}}', "text.format")
    if fmt["type"] == "json_schema" and not isinstance(fmt.get("schema"), dict):
        raise OpenAIError(400, "text.format.schema: a json_schema format needs a schema object",
                          "text.format.schema")
    if fmt["type"] == "json_schema" and not isinstance(fmt.get("name"), str):
        raise OpenAIError(400, "text.format.name: a json_schema format needs a name (as "
                          "OpenAI's)", "text.format.name")
    return fmt


def to_chat_request(body: ResponsesRequest, history: list[dict[str, Any]], drop: int = 0
                    ) -> ChatCompletionRequest:
    """The chat completion request that asks the same, after `history`; without the first
    `drop` messages of the conversation (and tool results their dropping leaves unasked),
    as `truncation: "auto"` shortens it."""
    body.check_supported()
    check_call_outputs(body.input, history)
    check_include(body.include)
    conversation = (history + input_messages(body.input))[drop:]
    while drop and len(conversation) > 1 and conversation[0]["role"] == "tool":
        conversation = conversation[1:]
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions
                else []) + conversation
    chat: dict[str, Any] = {"model": body.model, "messages": messages,
                            "max_tokens": body.max_output_tokens,
                            "temperature": body.temperature, "top_p": body.top_p,
                            "parallel_tool_calls": body.parallel_tool_calls}
    if body.logprobs:
        chat.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    if body.tools:
        for i, tool in enumerate(body.tools):
            if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                raise OpenAIError(400, f"tools[{i}]: pkv serves function tools (with a name)",
                                  f"tools[{i}]")
        chat["tools"] = [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description"),
            "parameters": t.get("parameters")}} for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise OpenAIError(400, "tool_choice: a function choice needs a name", "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = _text_format(body.text)
    if fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    elif fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    try:
        return chat_request_from(chat, CHAT_TO_RESPONSES)
    except OpenAIError as exc:  # a tool's field, named where a Responses tool holds it
        if exc.param is not None and (tool := _TOOL_FIELD.match(exc.param)):
            named = f"tools[{tool[1]}].{tool[2]}"
            exc.message, exc.param = exc.message.replace(exc.param, named, 1), named
        raise


def input_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` (checked by input_messages) as the items GET .../input_items lists: each with
    an id (its own, else a new one), a message's text as content parts."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    listed = []
    for item in items:
        kind = item.get("type", "message")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}[kind]
        out = {**item, "type": kind, "id": item.get("id") or f"{prefix}_{uuid.uuid4().hex}"}
        if kind == "message":
            part = "output_text" if item["role"] == "assistant" else "input_text"
            if isinstance(item.get("content"), str):
                out["content"] = [{"type": part, "text": item["content"]}]
            # An output_text part always lists its annotations (the SDK's type needs them).
            out["content"] = [{**c, "annotations": c.get("annotations") or []}
                              if c.get("type") == "output_text" else c for c in out["content"]]
        if kind != "reasoning":  # a status is part of every other item's type
            out.setdefault("status", "completed")
        listed.append(out)
    return listed


def output_items(message: dict[str, Any], ids: ResponseIds) -> list[dict[str, Any]]:
    """An OpenAI assistant message as Responses output items."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": ids.new("rs"), "summary": [],
                      "content": [{"type": "reasoning_text",
                                   "text": message["reasoning_content"]}]})
    if message.get("content"):
        items.append({"type": "message", "id": ids.new("msg"), "status": "completed",
                      "role": "assistant", "content": [
                          {"type": "output_text", "text": message["content"],
                           "annotations": [], "logprobs": []}]})
    for call in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": ids.new("fc"), "call_id": call["id"],
                      "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})
    return items


class ResponseIds:
    """Output item ids of one response: its id's tail and a counter."""

    def __init__(self, response_id: str) -> None:
        self.base, self.n = response_id.removeprefix("resp_"), 0

    def new(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}_{self.base}{self.n:02d}"


def response_usage(final: RequestOutput) -> dict[str, Any]:
    """A finished request's usage, in the Responses shape."""
    prompt = len(final.prompt_token_ids or [])
    output = sum(len(c.token_ids) for c in final.outputs)
    return {"input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output,
            # Nothing is written to a cache on request (the prefix cache is automatic), as
            # the Messages API's cache_creation_input_tokens says too.
            "input_tokens_details": {"cached_tokens": max(0, final.num_cached_tokens),
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}
