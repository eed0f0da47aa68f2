"""`POST /v1/messages`: Anthropic's Messages API on the chat machinery.

A request becomes a chat completion request (system prompt, text, `tool_use` and
`tool_result` blocks, tools and `tool_choice` mapped to OpenAI's), runs through
OpenAIServingChat's template, tools and reasoning parser, and its answer comes back as
Anthropic content blocks (`thinking`, `text`, `tool_use`), whole or as Anthropic's event
stream:

    message_start, (content_block_start, content_block_delta..., content_block_stop)...,
    message_delta (stop_reason, usage), message_stop
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from pkv.core.engine.async_engine import RequestStream
from pkv.core.engine.outputs import CompletionOutput, RequestOutput
from pkv.core.server.chat_choice import ChoiceShaper
from pkv.core.server.errors import OpenAIError, anthropic_error
from pkv.core.server.protocol import STRICT, ChatCompletionRequest, RequestBody
from pkv.core.server.serving_chat import OpenAIServingChat, chat_request_from, named_as
from pkv.core.server.serving_engine import (EngineStreamingResponse, single_choice_deltas,
                                            stream_error)


class AnthropicTool(BaseModel):
    model_config = STRICT
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicMessage(BaseModel):
    model_config = STRICT
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicThinking(BaseModel):
    """`enabled` (with a budget), `adaptive` (the model decides how long: no budget) or
    `disabled`; `display: omitted` keeps the thinking blocks but not their text."""

    model_config = STRICT
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class MessagesRequest(RequestBody):
    """The body of POST /v1/messages (fields pkv does not use are accepted and ignored, but
    remote MCP servers, which would change what the model can do, are refused)."""

    model: str | None = None  # optional, as the OpenAI endpoints' (llama.cpp's too)
    max_tokens: int
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    thinking: AnthropicThinking | None = None
    # Structured outputs: output_config.format, or the beta's output_format.
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    mcp_servers: Any = None  # named only to be refused

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow, if any."""
        for field, fmt in (("output_config.format", (self.output_config or {}).get("format")),
                           ("output_format", self.output_format)):
            if fmt is None:
                continue
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
                    or not isinstance(fmt.get("schema"), dict):
                raise OpenAIError(400, f"{field}: expected {{\"type\": \"json_schema\", "
                                  "\"schema\": {...}}", field)
            return fmt["schema"]
        return None


class CountTokensRequest(RequestBody):
    """The body of POST /v1/messages/count_tokens: a Messages conversation, no max_tokens."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """The text of a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(400, f"{where}: expected a string or a list of text blocks", where)
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" \
                or not isinstance(block.get("text"), str):
            raise OpenAIError(400, f"{where}[{i}]: expected a text block", where)
    return "\n".join(block["text"] for block in content)  # as chat joins text parts


def _check_answered(asked: set[str], answered: set[str], where: str) -> None:
    """A 400 where a user turn leaves a call of the turn before it unanswered (Anthropic's
    rule: every call is answered at once, in the next message)."""
    if asked - answered:
        raise OpenAIError(400, f"{where}: tool_use ids {sorted(asked - answered)} have no "
                          "tool_result block in this message (the one after them)", where)


def _user_messages(content: list[dict[str, Any]], where: str, asked: set[str]
                   ) -> list[dict[str, Any]]:
    """A user turn's blocks as OpenAI messages: each tool result its own `tool` message
    (first, as they answer the previous turn's calls: `asked`, its tool_use ids), then the
    text."""
    out: list[dict[str, Any]] = []
    text = []
    _check_answered(asked, {block["tool_use_id"] for block in content
                            if block.get("type") == "tool_result"
                            and isinstance(block.get("tool_use_id"), str)}, where)
    for i, block in enumerate(content):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            if block["tool_use_id"] not in asked:
                raise OpenAIError(400, f"{where}[{i}]: tool_result for "
                                  f"{block['tool_use_id']!r}, which no tool_use block of the "
                                  "previous message asked for", f"{where}[{i}]")
            given = block.get("content")
            result = _text("" if given is None else given, f"{where}[{i}].content")
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        else:
            raise OpenAIError(400, f"{where}[{i}]: a user turn takes text and tool_result "
                              "blocks (with tool_use_id)", f"{where}[{i}]")
    if text:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant_message(content: list[dict[str, Any]], where: str) -> dict[str, Any]:
    """An assistant turn's blocks as one OpenAI message with text and tool calls (earlier
    thinking is not shown to the model again)."""
    text, calls = [], []
    for i, block in enumerate(content):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input"), dict)):
                raise OpenAIError(400, f"{where}[{i}]: a tool_use block needs id, name and an "
                                  "input object", f"{where}[{i}]")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind not in ("thinking", "redacted_thinking"):
            raise OpenAIError(400, f"{where}[{i}]: an assistant turn takes text, tool_use and "
                              "thinking blocks", f"{where}[{i}]")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = calls
    return message


# Chat fields by the Messages field that gave them (errors name what the client sent).
CHAT_TO_MESSAGES = {"stop": "stop_sequences", "thinking_token_budget": "thinking.budget_tokens",
                    "response_format": "output_config.format"}


def shows_thinking(body: MessagesRequest) -> bool:
    """Whether thinking blocks carry their text (all but `display: omitted`)."""
    return body.thinking is None or body.thinking.display != "omitted"


def to_chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request that asks the same."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system, "system")})
    asked: set[str] = set()  # the tool_use ids of the previous (assistant) message
    for i, turn in enumerate(body.messages):
        where = f"messages[{i}].content"
        if isinstance(turn.content, str):
            if turn.role == "user":
                _check_answered(asked, set(), where)
            messages.append({"role": turn.role, "content": turn.content})
        elif turn.role == "user":
            messages += _user_messages(turn.content, where, asked)
        else:
            messages.append(_assistant_message(turn.content, where))
        asked = {call["id"] for call in messages[-1].get("tool_calls") or []} \
            if turn.role == "assistant" else set()
    if body.mcp_servers:
        raise OpenAIError(400, "mcp_servers: remote MCP servers are not served; give their "
                          "tools as tools", "mcp_servers")
    # A final assistant turn is a prefill: the answer goes on from its text, as Anthropic's.
    prefill = body.messages[-1].role == "assistant"
    if prefill and messages[-1].get("tool_calls"):  # (Anthropic refuses it: nothing to go on)
        where = f"messages[{len(body.messages) - 1}].content"
        raise OpenAIError(400, f"{where}: a final assistant turn is a prefill of text; its "
                          "tool_use blocks need a user turn with their tool_result after it",
                          where)
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_tokens": body.max_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
        "stop": body.stop_sequences, "stream": body.stream,
        "add_generation_prompt": not prefill, "continue_final_message": prefill}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise OpenAIError(400, "tool_choice: type tool needs a name", "tool_choice")
        chat["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                               if choice.type == "tool"
                               else {"any": "required"}.get(choice.type, choice.type))
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    schema = body.output_schema()
    if schema is not None:
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": schema}}
    # Anthropic's thinking is off unless asked for, whatever a template's own default
    # (Qwen3's is on): a client reading content[0].text gets text.
    thinks = body.thinking is not None and body.thinking.type != "disabled"
    chat["chat_template_kwargs"] = {"enable_thinking": thinks}
    if body.thinking is not None:
        budget = body.thinking.budget_tokens
        if body.thinking.type == "enabled" and budget is not None:
            if budget >= body.max_tokens:  # the answer would have no room
                raise OpenAIError(400, f"thinking.budget_tokens ({budget}) must be less than "
                                  f"max_tokens ({body.max_tokens})", "thinking.budget_tokens")
            chat["thinking_token_budget"] = budget
    return chat_request_from(chat, CHAT_TO_MESSAGES)


def stop_reason(finish: str | None, c: CompletionOutput) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished choice."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def content_blocks(message: dict[str, Any], show_thinking: bool) -> list[dict[str, Any]]:
    """An OpenAI assistant message as Anthropic content blocks (a thinking block's text left
    out unless `show_thinking`)."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "signature": "",
                       "thinking": message["reasoning_content"] if show_thinking else ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]),
                       "name": call["function"]["name"],
                       "input": _tool_input(call["function"]["arguments"])})
    return blocks


def _tool_input(arguments: str) -> dict[str, Any]:
    """A tool_use block's input: the call's arguments, or {} for those max_tokens cut off
    (its stop_reason says so; a stream has sent what they held)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_use_id(call_id: str) -> str:
    """Anthropic's form of a tool call's id (`toolu_...`; the engine's are OpenAI's
    `call_...`). The client sends it back in tool_result blocks, where it is only text."""
    return "toolu_" + call_id.removeprefix("call_") if call_id else call_id


def _usage(final: RequestOutput) -> dict[str, int]:
    """Anthropic's usage: the prompt's tokens read from the prefix cache apart from the rest
    (input_tokens), as its prompt caching counts them."""
    cached = max(0, final.num_cached_tokens)
    return {"input_tokens": len(final.prompt_token_ids or []) - cached,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": sum(len(c.token_ids) for c in final.outputs)}


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps({'type': name, **payload})}\n\n".encode()


class AnthropicServingMessages:
    """POST /v1/messages on an OpenAIServingChat."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def messages(self, body: MessagesRequest, raw: Request
                       ) -> JSONResponse | StreamingResponse:
        try:
            prepared, stream, [shaper] = await self.chat.start(to_chat_request(body), raw)
        except OpenAIError as exc:
            raise named_as(exc, CHAT_TO_MESSAGES) from None
        message_id = "msg_" + prepared.request_id.removeprefix("chatcmpl-")
        base = {"id": message_id, "type": "message", "role": "assistant",
                "model": self.chat.served_name(body.model)}
        if body.stream:
            prompt_tokens = prepared.children[0].num_prompt_tokens
            blocks = _BlockStream(shows_thinking(body))
            return EngineStreamingResponse(
                self._stream(base, prompt_tokens, stream, shaper, blocks), [stream])
        final = await self.chat.collect(stream, raw)
        c = final.outputs[0]
        message, finish = shaper.message(c.text, c.finish_reason)
        reason, sequence = stop_reason(finish, c)
        return JSONResponse({**base, "content": content_blocks(message, shows_thinking(body)),
                             "stop_reason": reason,
                             "stop_sequence": sequence, "usage": _usage(final)})

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        """The tokens a Messages request with this conversation takes as its prompt (its
        usage.input_tokens), counted without running it."""
        # max_tokens does not change the prompt; it only has to leave a thinking budget room
        budget = body.thinking.budget_tokens if body.thinking is not None else None
        request = to_chat_request(MessagesRequest(**dict(body), max_tokens=(budget or 0) + 1))
        try:
            return {"input_tokens": len(await self.chat.prompt_ids(request))}
        except OpenAIError as exc:
            raise named_as(exc, CHAT_TO_MESSAGES) from None

    async def _stream(self, base: dict[str, Any], prompt_tokens: int, stream: RequestStream,
                      shaper: ChoiceShaper, blocks: _BlockStream) -> AsyncIterator[bytes]:
        yield _event("message_start", {"message": {
            **base, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
        yield _event("ping", {})  # (Anthropic's stream sends one here)
        final = None
        try:
            async for final, delta in single_choice_deltas(stream, shaper):
                for chunk in blocks.feed(delta):
                    yield chunk
        except Exception as exc:
            yield _event("error", {"error": anthropic_error(stream_error(exc))["error"]})
            return
        for chunk in blocks.close():
            yield chunk
        if final is not None:
            c = final.outputs[0]
            finish = "tool_calls" if c.finish_reason == "stop" and shaper.called \
                else c.finish_reason
            reason, sequence = stop_reason(finish, c)
            yield _event("message_delta", {"delta": {"stop_reason": reason,
                                                     "stop_sequence": sequence},
                                           "usage": _usage(final)})
        yield _event("message_stop", {})


class _BlockStream:
    """OpenAI chat deltas in, Anthropic content-block events out: a new block opens when
    the kind of delta changes (thinking, text, each tool call). Without `show_thinking` a
    thinking block opens and closes with no text in it."""

    def __init__(self, show_thinking: bool) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text" or a tool call's index
        self.show_thinking = show_thinking

    def _start(self, key: str, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = key
        return out + [_event("content_block_start", {"index": self.index,
                                                     "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def feed(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            if self.open != "thinking":
                out += self._start("thinking", {"type": "thinking", "thinking": "",
                                                "signature": ""})
            if self.show_thinking:
                out.append(self._delta({"type": "thinking_delta",
                                        "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.open != "text":
                out += self._start("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            key = f"tool{call['index']}"
            function = call.get("function") or {}
            if self.open != key:
                out += self._start(key, {"type": "tool_use",
                                         "id": tool_use_id(call.get("id", "")),
                                         "name": function.get("name", ""), "input": {}})
            if function.get("arguments"):
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": function["arguments"]}))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        # A thinking block ends with its signature, as Anthropic's stream has it (pkv signs
        # nothing: an empty one, as the whole message's block carries).
        out = [self._delta({"type": "signature_delta", "signature": ""})] \
            if self.open == "thinking" else []
        self.open = None
        return out + [_event("content_block_stop", {"index": self.index})]
