"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`, `GET
/v1/responses/{id}/input_items`, `POST /v1/responses/{id}/cancel`: OpenAI's Responses API on
the chat machinery.

`input` (a string, or items: messages, `function_call`, `function_call_output`), after the
`instructions` and the stored conversation of `previous_response_id`, becomes a chat
completion request (responses_items.py); its answer comes back as output items
(`reasoning`, `message` with `output_text`, `function_call`), whole or as the Responses
event stream:

    response.created, response.in_progress,
      response.output_item.added, response.content_part.added,
        response.output_text.delta..., response.output_text.done,
      response.content_part.done, response.output_item.done,      (per message item)
      response.output_item.added, response.function_call_arguments.delta...,
        response.function_call_arguments.done, response.output_item.done   (per call)
    response.completed

Stored responses (`store`, on by default) live in a bounded per-tenant LRU with a TTL: one
API key never reads another's. A `background` response answers at once (`queued`) and runs
on; GET polls it (`in_progress` ... `completed`), cancel stops it (`cancelled`) and its
engine request with it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pkv.core.engine.async_engine import RequestStream
from pkv.core.engine.input_processor import ContextLengthError, check_context_length
from pkv.core.engine.outputs import RequestOutput
from pkv.core.server import logprobs_format as lpf
from pkv.core.server.chat_choice import ChoiceShaper
from pkv.core.server.errors import OpenAIError
from pkv.core.server.middleware import request_tenant
from pkv.core.server.protocol import ChatCompletionRequest
from pkv.core.server.responses_items import (CHAT_TO_RESPONSES, ResponseIds, ResponsesRequest,
                                             input_items, output_items, response_usage,
                                             to_chat_request)
from pkv.core.server.serving_chat import OpenAIServingChat, named_as
from pkv.core.server.serving_engine import (EngineStreamingResponse, single_choice_deltas,
                                            stream_error)
from pkv.core.server.tools import json_object


@dataclass
class _Turn:
    """What a response was asked, with what came before it (`previous_response_id`'s
    turns): as chat messages (a stored response's through its answer, for a follow-up to
    continue) and as input items (for GET .../input_items)."""

    messages: list[dict[str, Any]]
    inputs: list[dict[str, Any]]


@dataclass
class _Stored:
    response: dict[str, Any]
    turn: _Turn
    created: float
    size: int = 0  # about the bytes it holds (set by the store)


def _size(stored: _Stored) -> int:
    """About the bytes a stored response holds: its JSON and its turn's (the history a
    chain repeats in every turn)."""
    return len(json.dumps([stored.response, stored.turn.messages, stored.turn.inputs],
                          default=str))


@dataclass
class _Running:
    """A background response on its way: what cancel stops, and the output it has so far."""

    task: asyncio.Future
    stream: RequestStream
    shaper: ChoiceShaper
    base: dict[str, Any]  # the response's fields, for when the store has dropped it (LRU)
    turn: _Turn
    latest: RequestOutput | None = None

    def partial(self, status: str = "cancelled") -> dict[str, Any]:
        """The response as far as it got (its last item in progress, or incomplete once
        cancelled)."""
        base = self.base
        if self.latest is None:
            return {**base, "status": status}
        c = self.latest.outputs[0]
        message, _ = self.shaper.message(c.text, None)
        items = output_items(message, ResponseIds(base["id"]))
        if items:
            items[-1]["status"] = "incomplete" if status == "cancelled" else status
        return {**base, "status": status, "output": items,
                "usage": response_usage(self.latest)}


class ResponseStore:
    """Responses by tenant and id: each tenant's own `max_items` and `max_bytes` at most
    (least recently used out first, the newest always kept: one API key's traffic never
    evicts another's), each for `ttl` seconds."""

    def __init__(self, max_items: int = 1024, ttl: float = 3600.0,
                 max_bytes: int = 256 * 2**20) -> None:
        self.max_items, self.ttl, self.max_bytes = max_items, ttl, max_bytes
        self._tenants: dict[str | None, OrderedDict[str, _Stored]] = {}
        self._bytes: dict[str | None, int] = {}

    def put(self, tenant: str | None, stored: _Stored) -> None:
        items = self._tenants.setdefault(tenant, OrderedDict())
        self._drop_expired(tenant)
        self._pop(tenant, stored.response["id"])
        stored.size = _size(stored)
        items[stored.response["id"]] = stored
        self._bytes[tenant] = self._bytes.get(tenant, 0) + stored.size
        while len(items) > 1 and (len(items) > self.max_items
                                  or self._bytes[tenant] > self.max_bytes):
            self._pop(tenant, next(iter(items)))

    def __len__(self) -> int:
        for tenant in self._tenants:
            self._drop_expired(tenant)
        return sum(len(items) for items in self._tenants.values())

    def nbytes(self, tenant: str | None) -> int:
        """About the bytes `tenant`'s stored responses hold."""
        return self._bytes.get(tenant, 0)

    @property
    def capacity(self) -> int:
        """Responses the tenants seen so far may hold together."""
        return self.max_items * max(1, len(self._tenants))

    def _pop(self, tenant: str | None, response_id: str) -> _Stored | None:
        stored = self._tenants.get(tenant, OrderedDict()).pop(response_id, None)
        if stored is not None:
            self._bytes[tenant] -= stored.size
        return stored

    def _drop_expired(self, tenant: str | None) -> None:
        # A scan of at most max_items: the order is by use, not by age.
        now = time.time()
        items = self._tenants[tenant]
        for key in [k for k, s in items.items() if now - s.created > self.ttl]:
            self._pop(tenant, key)

    def delete(self, tenant: str | None, response_id: str) -> bool:
        return self._pop(tenant, response_id) is not None

    def get(self, tenant: str | None, response_id: str) -> _Stored | None:
        items = self._tenants.get(tenant)
        stored = None if items is None else items.get(response_id)
        if stored is None:
            return None
        if time.time() - stored.created > self.ttl:
            self._pop(tenant, response_id)
            return None
        items.move_to_end(response_id)  # type: ignore[union-attr]
        return stored


class OpenAIServingResponses:
    """POST /v1/responses and GET /v1/responses/{id} on an OpenAIServingChat."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()
        # Background responses still running (cancel stops them; GET reads how far they got).
        self._background: dict[tuple[str | None, str], _Running] = {}

    def retrieve(self, response_id: str, raw: Request) -> dict[str, Any]:
        """A stored response; a background one still running, with its output so far."""
        tenant = request_tenant(raw.scope)
        stored = self.store.get(tenant, response_id)
        running = self._background.get((tenant, response_id))
        # (running: also when newer responses have pushed it out of the store)
        if running is not None and (running.latest is not None or stored is None):
            return running.partial("in_progress")
        if stored is None:
            raise OpenAIError(404, f"no stored response {response_id!r}", "response_id",
                              "not_found")
        return stored.response

    def input_items(self, response_id: str, raw: Request, limit: int = 20,
                    order: str = "desc", after: str | None = None,
                    before: str | None = None) -> dict[str, Any]:
        """The items a stored response was asked with, earlier turns' included (their
        inputs and outputs), as OpenAI's list: `limit` (1-100) from the cursor on, newest
        first unless `order` is asc; `after` / `before` an item id."""
        stored = self.store.get(request_tenant(raw.scope), response_id)
        if stored is None:
            raise OpenAIError(404, f"no stored response {response_id!r}", "response_id",
                              "not_found")
        if not 1 <= limit <= 100:
            raise OpenAIError(400, f"limit must be in [1, 100], got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise OpenAIError(400, f"order must be asc or desc, got {order!r}", "order")
        items = stored.turn.inputs if order == "asc" else stored.turn.inputs[::-1]
        ids = [item["id"] for item in items]
        for cursor, name in ((after, "after"), (before, "before")):
            if cursor is not None and cursor not in ids:
                raise OpenAIError(400, f"{name}: no item {cursor!r} in this response's input",
                                  name)
        start = ids.index(after) + 1 if after is not None else 0
        end = ids.index(before) if before is not None else len(items)
        page = items[start:end][:limit] if before is None else items[start:end][-limit:]
        return {"object": "list", "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items[start:end]) > len(page)}

    def delete(self, response_id: str, raw: Request) -> dict[str, Any]:
        """Forget a stored response; one still running in the background stops (its engine
        request is aborted) and is not stored again when it ends."""
        tenant = request_tenant(raw.scope)
        found = self.store.delete(tenant, response_id)
        running = self._background.pop((tenant, response_id), None)
        if running is not None:
            running.task.cancel()
            running.stream.close()
        if not found and running is None:
            raise OpenAIError(404, f"no stored response {response_id!r}", "response_id",
                              "not_found")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def cancel(self, response_id: str, raw: Request) -> dict[str, Any]:
        """Stop a background response (its engine request is aborted); a finished one is
        returned as it is."""
        tenant = request_tenant(raw.scope)
        running = self._background.pop((tenant, response_id), None)
        if running is None:
            stored = self.store.get(tenant, response_id)
            if stored is None:
                raise OpenAIError(404, f"no stored response {response_id!r}", "response_id",
                                  "not_found")
            if not stored.response.get("background"):
                raise OpenAIError(400, "only background responses can be cancelled",
                                  "response_id")
            return stored.response
        cancelled = running.partial()
        self.store.put(tenant, _Stored(cancelled, running.turn, time.time()))
        running.task.cancel()
        running.stream.close()  # aborts the engine request (also if the task never started)
        return cancelled

    async def create(self, body: ResponsesRequest, raw: Request
                     ) -> JSONResponse | StreamingResponse:
        tenant = request_tenant(raw.scope)
        history: list[dict[str, Any]] = []  # previous turns as chat messages, and as items
        earlier_items: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = self.store.get(tenant, body.previous_response_id)
            if previous is None:
                raise OpenAIError(404, f"no stored response {body.previous_response_id!r}",
                                  "previous_response_id", "not_found")
            history = previous.turn.messages
            earlier_items = previous.turn.inputs + previous.response["output"]
        if body.background and (body.stream or not body.store):
            raise OpenAIError(400, "background responses need store=true and stream=false "
                              "(poll GET /v1/responses/{id})", "background")
        chat_body = await self._fitted(body, history)
        try:
            prepared, stream, [shaper] = await self.chat.start(chat_body, raw)
        except OpenAIError as exc:
            raise named_as(exc, CHAT_TO_RESPONSES) from None
        response_id = "resp_" + prepared.request_id.removeprefix("chatcmpl-")
        base = self._skeleton(body, response_id)
        # What a follow-up continues: this turn's messages and its answer (the instructions
        # are each request's own).
        messages = chat_body.model_dump(exclude_none=True)["messages"]
        turn = _Turn(messages[1:] if body.instructions else messages,
                     earlier_items + input_items(body.input))
        if body.stream:
            return EngineStreamingResponse(
                self._stream(body, base, stream, shaper, tenant, turn), [stream])
        if body.background:
            queued = {**base, "status": "queued"}
            self.store.put(tenant, _Stored(queued, turn, time.time()))
            running = _Running(asyncio.ensure_future(
                self._run_background(body, base, stream, shaper, tenant, turn)), stream, shaper,
                base, turn)
            self._background[(tenant, response_id)] = running
            return JSONResponse(queued)
        final = await self.chat.collect(stream, raw)
        response = self._finish(body, base, final, shaper, tenant, turn)
        return JSONResponse(response)

    async def _fitted(self, body: ResponsesRequest, history: list[dict[str, Any]]
                      ) -> ChatCompletionRequest:
        """The chat request; under `truncation: "auto"` without the fewest earliest messages
        that let it fit max_model_len (OpenAI drops items from the conversation's start)."""
        chat_body = to_chat_request(body, history)
        if body.truncation != "auto" or await self._fits(chat_body):
            return chat_body
        least, most = 1, len(chat_body.messages) - (2 if body.instructions else 1)
        if most < least or not await self._fits(to_chat_request(body, history, most)):
            return chat_body  # even the last message alone is too long: chat says so
        while least < most:  # the least drop that fits; fitting only grows with the drop
            middle = (least + most) // 2
            if await self._fits(to_chat_request(body, history, middle)):
                most = middle
            else:
                least = middle + 1
        return to_chat_request(body, history, least)

    async def _fits(self, chat_body: ChatCompletionRequest) -> bool:
        """Whether the engine would take this conversation's prompt (its own rule)."""
        try:
            prompt = await self.chat.prompt_ids(chat_body)
        except OpenAIError as exc:
            raise named_as(exc, CHAT_TO_RESPONSES) from None
        try:
            check_context_length(len(prompt), chat_body.max_tokens,
                                 self.chat.llm.engine.max_model_len)
        except ContextLengthError:
            return False
        return True

    def _skeleton(self, body: ResponsesRequest, response_id: str) -> dict[str, Any]:
        defaults = self.chat.llm.engine.sampling_defaults  # (generation_config.json's)
        return {"id": response_id, "object": "response", "created_at": int(time.time()),
                "completed_at": None,
                "status": "in_progress", "model": self.chat.served_name(body.model), "output": [],
                "instructions": body.instructions, "tools": body.tools or [],
                "tool_choice": body.tool_choice or "auto",
                "parallel_tool_calls": body.parallel_tool_calls,
                # the values it runs with: the model's defaults (else OpenAI's) where not sent
                "temperature": (defaults.get("temperature", 1.0) if body.temperature is None
                                else body.temperature),
                "top_p": defaults.get("top_p", 1.0) if body.top_p is None else body.top_p,
                "top_logprobs": body.top_logprobs or 0,
                "max_output_tokens": body.max_output_tokens,
                "previous_response_id": body.previous_response_id,
                "text": body.text or {"format": {"type": "text"}}, "reasoning": body.reasoning,
                "store": body.store, "background": body.background,
                "truncation": body.truncation or "disabled",
                "metadata": body.metadata or {}, "error": None,
                "incomplete_details": None, "usage": None}

    def _finish(self, body: ResponsesRequest, base: dict[str, Any], final: RequestOutput,
                shaper: ChoiceShaper, tenant: str | None, turn: _Turn,
                items: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The completed response (stored when asked); `items` when a stream built them."""
        c = final.outputs[0]
        message, _ = shaper.message(c.text, c.finish_reason)
        length = c.finish_reason == "length"
        if items is None:
            items = output_items(message, ResponseIds(base["id"]))
            if length and items:  # the item max_output_tokens cut short
                items[-1]["status"] = "incomplete"
        else:  # the stored turn keeps the call ids the stream showed, not fresh ones
            calls = [item for item in items if item["type"] == "function_call"]
            for call, item in zip(message.get("tool_calls") or [], calls):
                call["id"] = item["call_id"]
        if body.logprobs:
            _attach_logprobs(items, c.logprobs, c.token_ids, body.top_logprobs or 0)
        response = {**base, "status": "incomplete" if length else "completed",
                    "completed_at": None if length else int(time.time()),
                    "incomplete_details": {"reason": "max_output_tokens"} if length else None,
                    "output": items, "usage": response_usage(final)}
        if body.store:
            self.store.put(tenant, _Stored(response, _Turn(turn.messages + [_answer(message)],
                                                           turn.inputs), time.time()))
        return response

    async def _run_background(self, body: ResponsesRequest, base: dict[str, Any],
                              stream: RequestStream, shaper: ChoiceShaper, tenant: str | None,
                              turn: _Turn) -> None:
        """Run a background response to its end, storing where it stands; nobody waits on
        it, so the client going away does not stop it (cancel does)."""
        key = (tenant, base["id"])
        self.store.put(tenant, _Stored({**base, "status": "in_progress"}, turn, time.time()))
        try:
            final = None
            async for final in stream.outputs():
                running = self._background.get(key)
                if running is not None:  # (cancel reads how far it got)
                    running.latest = final
            # (cancelled or deleted meanwhile: what cancel stored stays, a deletion stays)
            if final is not None and key in self._background:
                self._finish(body, base, final, shaper, tenant, turn)
        except Exception as exc:  # the engine failed it: the stored response says so
            if key not in self._background:
                return
            # "server_error": the one code of the API's list for what the engine reports
            failed = {**base, "status": "failed",
                      "error": {"code": "server_error",
                                "message": stream_error(exc)["error"]["message"]}}
            self.store.put(tenant, _Stored(failed, turn, time.time()))
        finally:
            stream.close()
            self._background.pop(key, None)

    async def _stream(self, body: ResponsesRequest, base: dict[str, Any], stream: RequestStream,
                      shaper: ChoiceShaper, tenant: str | None,
                      turn: _Turn) -> AsyncIterator[bytes]:
        events = _EventStream(base["id"])
        try:
            yield events.emit("response.created", {"response": base})
            yield events.emit("response.in_progress", {"response": base})
            async with aclosing(self._stream_events(body, base, stream, shaper, tenant, turn,
                                                    events)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:  # a client gone before the end: stored as cancelled, with what it got
            if body.store and not events.finished:
                events.close("incomplete")
                self.store.put(tenant, _Stored({**base, "status": "cancelled",
                                                "output": events.items}, turn, time.time()))

    async def _stream_events(self, body: ResponsesRequest, base: dict[str, Any],
                             stream: RequestStream, shaper: ChoiceShaper, tenant: str | None,
                             turn: _Turn, events: _EventStream) -> AsyncIterator[bytes]:
        final = None
        sent = 0  # tokens whose logprobs an output_text delta has carried
        try:
            async for final, delta in single_choice_deltas(stream, shaper):
                c = final.outputs[0]
                logprobs = None
                if body.logprobs and delta.get("content"):
                    logprobs = _logprobs(c.logprobs[sent:] if c.logprobs else None,
                                         c.token_ids[sent:],
                                         body.top_logprobs or 0)
                    sent = len(c.token_ids)
                for chunk in events.feed(delta, logprobs):
                    yield chunk
        except Exception as exc:  # Responses' error event: type "error", code, message, param
            events.finished = True
            error = stream_error(exc)["error"]
            code = error["code"] or {"internal_server_error": "server_error"}.get(
                error["type"], error["type"])
            yield events.emit("error", {"code": code,
                                        "message": error["message"], "param": error["param"]})
            return
        cut = final is not None and final.outputs[0].finish_reason == "length"
        for chunk in events.close("incomplete" if cut else "completed"):
            yield chunk
        if final is not None:
            response = self._finish(body, base, final, shaper, tenant, turn, events.items)
            events.finished = True
            kind = "response.completed" if response["status"] == "completed" \
                else "response.incomplete"
            yield events.emit(kind, {"response": response})


class _EventStream:
    """Chat deltas in, Responses events out: an item opens when the kind of delta changes
    (reasoning, message text, each function call) and is done when the next one opens."""

    def __init__(self, response_id: str) -> None:
        self.ids = ResponseIds(response_id)
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: str | None = None
        self.finished = False  # the response is complete (and stored, if asked) or failed

    def emit(self, kind: str, payload: dict[str, Any]) -> bytes:
        self.sequence += 1
        data = {"type": kind, "sequence_number": self.sequence - 1, **payload}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _start(self, key: str, item: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.items.append(item)
        self.open = key
        # A message's (or reasoning's) part arrives in its own event (content_part.added), as
        # OpenAI sends it: clients that add each part up would hold the empty one twice.
        parted = item["type"] in ("message", "reasoning")
        added = {**item, "content": []} if parted else item
        out.append(self.emit("response.output_item.added", {"output_index": self._index,
                                                            "item": added}))
        if parted:
            part = {k: v for k, v in item["content"][0].items() if k != "logprobs"}
            out.append(self.emit("response.content_part.added", {
                "item_id": item["id"], "output_index": self._index, "content_index": 0,
                "part": part}))
        return out

    def feed(self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None = None
             ) -> list[bytes]:
        """The events of a chat delta; `logprobs`, its content's tokens' (when asked)."""
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            if self.open != "reasoning":
                out += self._start("reasoning", {
                    "type": "reasoning", "id": self.ids.new("rs"), "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]})
            item = self.items[-1]
            item["content"][0]["text"] += delta["reasoning_content"]
            out.append(self.emit("response.reasoning_text.delta", {
                "item_id": item["id"], "output_index": self._index, "content_index": 0,
                "delta": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.open != "message":
                out += self._start("message", {
                    "type": "message", "id": self.ids.new("msg"), "status": "in_progress",
                    "role": "assistant", "content": [{"type": "output_text", "text": "",
                                                      "annotations": [], "logprobs": []}]})
            item = self.items[-1]
            item["content"][0]["text"] += delta["content"]
            item["content"][0]["logprobs"] += logprobs or []
            out.append(self.emit("response.output_text.delta", {
                "item_id": item["id"], "output_index": self._index, "content_index": 0,
                "delta": delta["content"], "logprobs": logprobs or []}))
        for call in delta.get("tool_calls") or []:
            key = f"call{call['index']}"
            function = call.get("function") or {}
            if self.open != key:
                out += self._start(key, {
                    "type": "function_call", "id": self.ids.new("fc"),
                    "call_id": call.get("id", ""), "name": function.get("name", ""),
                    "arguments": "", "status": "in_progress"})
            if function.get("arguments"):
                item = self.items[-1]
                item["arguments"] += function["arguments"]
                out.append(self.emit("response.function_call_arguments.delta", {
                    "item_id": item["id"], "output_index": self._index,
                    "delta": function["arguments"]}))
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        """The open item's closing events, the item's `status` with them (the last item of a
        response max_output_tokens cut short is incomplete)."""
        if self.open is None:
            return []
        self.open = None
        item, index = self.items[-1], self._index
        out: list[bytes] = []
        if item["type"] == "message":
            text = item["content"][0]["text"]
            out.append(self.emit("response.output_text.done", {
                "item_id": item["id"], "output_index": index, "content_index": 0, "text": text,
                "logprobs": item["content"][0]["logprobs"]}))
            out.append(self.emit("response.content_part.done", {
                "item_id": item["id"], "output_index": index, "content_index": 0,
                "part": item["content"][0]}))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out.append(self.emit("response.reasoning_text.done", {
                "item_id": item["id"], "output_index": index, "content_index": 0,
                "text": part["text"]}))
            out.append(self.emit("response.content_part.done", {
                "item_id": item["id"], "output_index": index, "content_index": 0,
                "part": part}))
        elif item["type"] == "function_call":
            out.append(self.emit("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": index, "name": item["name"],
                "arguments": item["arguments"]}))
        if "status" in item:
            item["status"] = status
        out.append(self.emit("response.output_item.done", {"output_index": index,
                                                           "item": item}))
        return out


def _answer(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant turn a follow-up's history holds: without its thinking, and without a
    call max_tokens cut off (no JSON object to render: the conversation goes on from the
    whole ones, or from the text)."""
    answer = {k: v for k, v in message.items() if k != "reasoning_content"}
    calls = [c for c in answer.get("tool_calls") or [] if json_object(c["function"]["arguments"])]
    if len(calls) < len(answer.get("tool_calls") or []):
        answer["tool_calls"] = calls or None
        if not calls and answer.get("content") is None:
            answer["content"] = ""
    return answer


def _logprobs(entries: list | None, token_ids: list[int], top_n: int) -> list[dict[str, Any]]:
    """Tokens' logprobs as an output_text part carries them (chat's entries)."""
    return (lpf.chat(entries, token_ids, top_n) or {"content": []})["content"]


def _attach_logprobs(items: list[dict[str, Any]], entries: list | None, token_ids: list[int],
                     top_n: int) -> None:
    """Every generated token's logprobs on the first output_text part (as vLLM puts them),
    streamed or not alike."""
    for item in items:
        if item["type"] == "message":
            item["content"][0]["logprobs"] = _logprobs(entries, token_ids, top_n)
            return
