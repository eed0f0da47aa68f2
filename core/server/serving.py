"""OpenAIServing: chat and text completions on top of AsyncLLM, streamed (SSE) or not.

Everything that can refuse a request (validation, limits, admission) happens before the
first byte of a response, so a refusal is a status code and never a truncated stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pkv.core.engine.async_engine import AsyncLLM, RequestStream
from pkv.core.engine.llm_engine import ContextLengthError, PreparedRequest
from pkv.core.engine.outputs import CompletionOutput, RequestOutput
from pkv.core.lora.adapter import LoRARequest
from pkv.core.sample.sampling_params import SamplingParams
from pkv.core.server import logprobs_format as lpf
from pkv.core.server.chat_choice import ChoiceShaper
from pkv.core.server.errors import OpenAIError, engine_error, error_body
from pkv.core.server.middleware import request_tenant
from pkv.core.server.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest,
                                      _SamplingFields)
from pkv.core.server.tools import (ToolPlan, check_tool_messages, plan_tools, template_knows_tools,
                                   template_messages)
from pkv.core.structured_output.params import StructuredOutputsParams
from pkv.core.structured_output.reasoning import END as REASONING_END
from pkv.core.structured_output.reasoning import ReasoningParser
from pkv.core.structured_output.tool_calls import ToolParser

logger = logging.getLogger("pkv.server")

# Template variables a request may set (chat templates of Qwen3 and others read these).
ALLOWED_TEMPLATE_KWARGS = frozenset({"enable_thinking", "reasoning_effort"})
TEMPLATE_TIMEOUT_S = 5.0
MAX_RENDERED_CHARS = 8 * 2**20


@dataclass
class ServerLimits:
    """Per-request limits; each breach is a 400 naming the field."""

    max_n: int = 16
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_length: int = 256
    max_prompts: int = 64  # prompts in one completions request
    max_cache_salt_length: int = 256


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class OpenAIServing:
    """Turns OpenAI request bodies into engine requests and engine outputs into responses."""

    def __init__(self, async_llm: AsyncLLM, served_model_name: str, limits: ServerLimits,
                 tool_parser: ToolParser | None = None,
                 reasoning_parser: ReasoningParser | None = None) -> None:
        self.llm = async_llm
        self.model_name = served_model_name
        self.limits = limits
        self.tokenizer = async_llm.engine.tokenizer
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser

    # ---- validation --------------------------------------------------------------------

    async def _render_chat(self, body: ChatCompletionRequest,
                           tools: list[dict] | None = None) -> str:
        """The server's own template, sandboxed by jinja, off the event loop, with a time
        and a size limit; requests may pass only allow-listed template variables."""
        if body.chat_template is not None:
            raise OpenAIError(400, "requests may not supply a chat template; the server uses "
                              "the model's own", "chat_template")
        kwargs = body.chat_template_kwargs or {}
        for key, value in kwargs.items():
            if key not in ALLOWED_TEMPLATE_KWARGS or not isinstance(value, (bool, int, str)) \
                    or len(str(value)) > 256:
                raise OpenAIError(400, f"chat_template_kwargs may hold only "
                                  f"{', '.join(sorted(ALLOWED_TEMPLATE_KWARGS))} with short "
                                  f"scalar values; got {key!r}", "chat_template_kwargs")
        check_messages(body.messages)
        tools, template = tools or [], self.tokenizer.chat_template or ""
        messages = template_messages([m.as_template_dict() for m in body.messages], tools,
                                     template)
        if tools and template_knows_tools(template):
            kwargs = {**kwargs, "tools": tools}
        try:
            text = await asyncio.wait_for(asyncio.to_thread(
                self.tokenizer.apply_chat_template, messages, True, **kwargs),
                timeout=TEMPLATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise OpenAIError(400, f"the chat template took over {TEMPLATE_TIMEOUT_S:.0f} s to "
                              "render these messages", "messages") from None
        except Exception as exc:  # jinja errors from the model's own template
            raise OpenAIError(400, f"cannot apply the chat template: {exc}", "messages") from None
        if len(text) > MAX_RENDERED_CHARS:
            raise OpenAIError(400, f"the rendered conversation exceeds {MAX_RENDERED_CHARS} "
                              "characters", "messages")
        return text

    def _check_common(self, body: _SamplingFields, logprobs: int | None,
                      logprobs_param: str = "logprobs") -> None:
        self._lora_request(body)  # an unknown model name is a 404 before anything else
        if not 1 <= body.n <= self.limits.max_n:
            raise OpenAIError(400, f"n must be between 1 and {self.limits.max_n}", "n")
        if logprobs is not None and not 0 <= logprobs <= self.limits.max_logprobs:
            raise OpenAIError(400, f"{logprobs_param} must be between 0 and "
                              f"{self.limits.max_logprobs}", logprobs_param)
        salt = body.cache_salt
        if salt is not None and (len(salt) > self.limits.max_cache_salt_length
                                 or not salt.isprintable()):
            raise OpenAIError(400, f"cache_salt must be printable and at most "
                              f"{self.limits.max_cache_salt_length} characters", "cache_salt")
        stops = body.stop_list
        if len(stops) > self.limits.max_stop_strings:
            raise OpenAIError(400, f"at most {self.limits.max_stop_strings} stop strings",
                              "stop")
        if any(len(s) > self.limits.max_stop_length for s in stops):
            raise OpenAIError(400, f"stop strings must be at most {self.limits.max_stop_length} "
                              "characters", "stop")

    @staticmethod
    def _params(body: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                names: dict[str, str] | None = None) -> SamplingParams:
        """SamplingParams of the request; a 400 naming the field the client sent (`names`
        maps SamplingParams' names to the request's where they differ)."""
        fields = body.constraint_fields()
        try:
            structured, field = body.structured()
        except ValueError as exc:
            param = fields[0] if len(fields) == 1 else "response_format"
            raise OpenAIError(400, str(exc), param) from None
        try:
            return body.sampling_params(max_tokens, logprobs, structured)
        except ValueError as exc:
            # SamplingParams messages start with the field's name.
            name = str(exc).split(" ", 1)[0]
            param = field if "structured outputs" in str(exc) else (names or {}).get(name, name)
            raise OpenAIError(400, str(exc), param) from None

    async def _prepare(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       body: _SamplingFields, param: str, raw: Request,
                       constraint_param: str | None = None) -> PreparedRequest:
        # Tenants (API keys) never share prefix-cache blocks: their name salts every hash.
        tenant = request_tenant(raw.scope)
        salt = body.cache_salt if tenant is None else f"{tenant}:{body.cache_salt or ''}"
        try:
            return await self.llm.prepare(request_id, prompt, params, salt,
                                          self._lora_request(body))
        except ContextLengthError as exc:
            raise OpenAIError(400, str(exc), param, "context_length_exceeded") from None
        except ValueError as exc:
            first = str(exc).split(" ", 1)[0]
            if "constraint" in str(exc):  # compiling the structured-output constraint failed
                param = constraint_param or body.structured()[1] or param
            elif first in type(body).model_fields:  # engine messages start with the field
                param = first
            raise OpenAIError(400, str(exc), param) from None

    def _lora_request(self, body: _SamplingFields) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 for a name nobody serves."""
        if body.model is None or body.model == self.model_name:
            return None
        lora = self.llm.engine.lora
        adapter = lora.adapters.get(body.model) if lora is not None else None
        if adapter is None:
            names = [self.model_name, *(lora.adapters if lora is not None else ())]
            raise OpenAIError(404, f"model {body.model!r} does not exist; this server serves "
                              f"{', '.join(map(repr, names))}", "model", "model_not_found")
        return LoRARequest(adapter.name, adapter.uid, adapter.path)

    # ---- chat --------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        top = body.top_logprobs
        self._check_common(body, top, "top_logprobs")
        top = (top or 0) if body.logprobs else None
        given = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        params = self._params(body, getattr(body, given), top,
                              {"max_tokens": given, "logprobs": "top_logprobs"})
        plan = plan_tools(body, self.tool_parser)
        if plan.schema is not None:
            params.structured_outputs = StructuredOutputsParams(json=plan.schema)
        if params.structured_outputs is not None and self._thinks(body):
            # The grammar constrains the answer, after the (free) thinking block.
            params.structured_outputs = dataclasses.replace(params.structured_outputs,
                                                            starts_after=REASONING_END)
        params.skip_special_tokens = plan.skip_special_tokens
        self._check_tools_fit(plan)
        text = await self._render_chat(body, plan.tools)
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        prepared = await self._prepare(request_id, prompt_ids, params, body, "messages", raw,
                                       "tools" if plan.schema is not None else None)
        # Queued (all or none) before any response starts: a full queue or a stopped engine
        # is a 503 (engine_error), never an error inside a started response.
        [stream] = self.llm.submit([prepared])
        shapers = [ChoiceShaper(plan.extractor, self.reasoning_parser)
                   for _ in prepared.children]
        if body.stream:
            return _EngineStreamingResponse(self._chat_stream(body, prepared, stream, shapers),
                                            [stream])
        final = await self._collect(stream, raw)
        choices = []
        for c in final.outputs:
            message, finish = shapers[c.index].message(c.text, c.finish_reason)
            choices.append({"index": c.index, "message": message,
                            "logprobs": lpf.chat(c.logprobs, c.token_ids, top or 0)
                            if body.logprobs else None, "finish_reason": finish})
        return JSONResponse({"id": request_id, "object": "chat.completion",
                             "created": int(time.time()), "model": self.model_name,
                             "choices": choices, "usage": _usage([final])})

    def _thinks(self, body: ChatCompletionRequest) -> bool:
        """Whether the answer opens with a thinking block to leave unconstrained."""
        kwargs = body.chat_template_kwargs or {}
        return self.reasoning_parser is not None and kwargs.get("enable_thinking") is not False

    def _check_tools_fit(self, plan: ToolPlan) -> None:
        if not plan.tools:
            return
        size = len(self.tokenizer.encode(json.dumps(plan.tools), add_special_tokens=False))
        limit = self.llm.engine.max_model_len
        if size >= limit:
            raise OpenAIError(400, f"the tools alone take {size} tokens, more than the model's "
                              f"context of {limit}", "tools", "context_length_exceeded")

    async def _chat_stream(self, body: ChatCompletionRequest, prepared: PreparedRequest,
                           stream: RequestStream, shapers: list[ChoiceShaper]
                           ) -> AsyncIterator[bytes]:
        base = {"id": prepared.request_id, "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.model_name}
        for i in range(len(shapers)):
            yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                   "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        tracker = _DeltaTracker()
        final = None
        try:
            async for output in stream.outputs():
                final = output
                for c in output.outputs:
                    new = tracker.advance(c.index, c)
                    if new is None:
                        continue
                    _, lps, ids = new
                    shaper = shapers[c.index]
                    delta = shaper.delta(c.text, c.finish_reason is not None)
                    logprobs = (lpf.chat(lps, ids, body.top_logprobs or 0)
                                if body.logprobs and lps else None)
                    if not delta and logprobs is None and c.finish_reason is None:
                        continue  # held back: it may still become markup
                    finish = ("tool_calls" if c.finish_reason == "stop" and shaper.called
                              else c.finish_reason)
                    yield _sse({**base, "choices": [{"index": c.index, "delta": delta,
                                                     "logprobs": logprobs,
                                                     "finish_reason": finish}]})
        except Exception as exc:
            yield _sse(_stream_error(exc))
        else:
            if body.include_usage and final is not None:
                yield _sse({**base, "choices": [], "usage": _usage([final])})
        yield _sse("[DONE]")

    # ---- completions -------------------------------------------------------------------

    async def completion(self, body: CompletionRequest, raw: Request
                         ) -> JSONResponse | StreamingResponse:
        self._check_common(body, body.logprobs)
        params = self._params(body, body.max_tokens if body.max_tokens is not None else 16,
                              body.logprobs)
        prompts = _prompt_list(body.prompt)
        if len(prompts) * body.n > self.limits.max_prompts:
            raise OpenAIError(400, f"at most {self.limits.max_prompts} prompts (times n) per "
                              "request", "prompt")
        base_id = f"cmpl-{uuid.uuid4().hex}"
        prepared = [await self._prepare(f"{base_id}-{i}", p, params, body, "prompt", raw)
                    for i, p in enumerate(prompts)]
        streams = self.llm.submit(prepared)
        if body.stream:
            return _EngineStreamingResponse(self._completion_stream(body, base_id, streams),
                                            streams)
        tasks = [asyncio.ensure_future(self._collect(s, raw)) for s in streams]
        try:
            finals = await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # one failed (client gone): stop the others with it
                task.cancel()
        choices = []
        for i, final in enumerate(finals):
            prefix = self._prompt_text(final) if body.echo else ""
            for c in final.outputs:
                choices.append({"index": i * body.n + c.index, "text": prefix + c.text,
                                "logprobs": lpf.completion(c.logprobs, c.token_ids,
                                                           body.logprobs or 0, len(prefix))
                                if body.logprobs is not None else None,
                                "finish_reason": c.finish_reason})
        return JSONResponse({"id": base_id, "object": "text_completion",
                             "created": int(time.time()), "model": self.model_name,
                             "choices": choices, "usage": _usage(finals)})

    async def _completion_stream(self, body: CompletionRequest, base_id: str,
                                 streams: list[RequestStream]) -> AsyncIterator[bytes]:
        base = {"id": base_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        tracker = _DeltaTracker()
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, output in _merge([s.outputs() for s in streams]):
                finals[i] = output
                for c in output.outputs:
                    index = i * body.n + c.index
                    echo = self._prompt_text(output) if body.echo and tracker.is_new(index) else ""
                    delta = tracker.advance(index, c)
                    if delta is None:
                        continue
                    text, lps, ids = delta
                    logprobs = (lpf.completion(lps, ids, body.logprobs or 0, len(echo))
                                if body.logprobs is not None and lps is not None else None)
                    yield _sse({**base, "choices": [{"index": index, "text": echo + text,
                                                     "logprobs": logprobs,
                                                     "finish_reason": c.finish_reason}]})
        except Exception as exc:
            yield _sse(_stream_error(exc))
        else:
            if body.include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(list(finals.values()))})
        yield _sse("[DONE]")

    def _prompt_text(self, output: RequestOutput) -> str:
        return output.prompt if output.prompt is not None else self.tokenizer.decode(
            output.prompt_token_ids)

    # ---- shared ------------------------------------------------------------------------

    async def _collect(self, stream: RequestStream, raw: Request) -> RequestOutput:
        """Run to the end; abort if the client disconnects while we wait."""
        async def last() -> RequestOutput:
            final = None
            async for output in stream.outputs():
                final = output
            if final is None:
                raise RuntimeError("the engine finished a request without an output")
            return final

        task = asyncio.ensure_future(last())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    break
                if await raw.is_disconnected():
                    raise OpenAIError(499, "client disconnected")
        finally:
            task.cancel()  # a no-op once done; else the generator's cleanup aborts the request
            stream.close()
        return task.result()  # engine failures reach the client through engine_error


class _EngineStreamingResponse(StreamingResponse):
    """An SSE response that closes its engine streams however it ends: finished, client
    gone, or never started at all (then the body generator's own cleanup never runs)."""

    def __init__(self, content: AsyncIterator[bytes], streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self.streams:
                stream.close()


class _DeltaTracker:
    """Remembers what each choice of a stream has sent, to emit only what is new."""

    def __init__(self) -> None:
        self.sent: dict[int, tuple[int, int]] = {}  # choice -> (chars, tokens) sent
        self.done: set[int] = set()

    def is_new(self, index: int) -> bool:
        return index not in self.sent

    def advance(self, index: int, c: CompletionOutput
                ) -> tuple[str, list | None, list[int]] | None:
        """(new text, new logprobs, new token ids) of a choice, or None if nothing to send."""
        if index in self.done:
            return None
        chars, tokens = self.sent.get(index, (0, 0))
        text = c.text[chars:]
        if not text and c.finish_reason is None and index in self.sent:
            return None
        self.sent[index] = (len(c.text), len(c.token_ids))
        if c.finish_reason is not None:
            self.done.add(index)
        lps = c.logprobs[tokens:] if c.logprobs is not None else None
        return text, lps, c.token_ids[tokens:]


def check_messages(messages: list[ChatMessage]) -> None:
    """A 400 naming the first message that has no content where OpenAI requires it, or
    whose tool calls or tool result are malformed."""
    check_tool_messages(messages)
    for i, message in enumerate(messages):
        if message.missing_content():
            raise OpenAIError(400, f"messages[{i}]: a {message.role} message needs content (a "
                              "string or a list of content parts), not null",
                              f"messages[{i}].content")


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]
                 ) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]  # type: ignore[list-item]
    if not prompt:
        raise OpenAIError(400, "prompt must not be empty", "prompt")
    return list(prompt)  # type: ignore[arg-type]


def _usage(finals: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(len(c.token_ids) for f in finals for c in f.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _stream_error(exc: Exception) -> dict:
    """The error event of a stream that already answered 200."""
    known = engine_error(exc)
    if known is None:
        logger.error("a stream failed", exc_info=exc)
        return error_body(500, "internal server error")
    return error_body(known.status, known.message, code=known.code)


async def _merge(gens: list[AsyncIterator[RequestOutput]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams, tagging each output with its stream's index."""
    if len(gens) == 1:
        async for output in gens[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in gen:
                await queue.put((i, output))
        except Exception as exc:
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
