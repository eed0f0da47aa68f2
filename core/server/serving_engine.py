"""OpenAIServing: what the chat and completions handlers share on top of AsyncLLM. Request
checks and limits, SamplingParams from a body, admission, collecting a non-streamed answer,
and the pieces of an SSE stream (serving_chat.py and serving_completion.py build on it).

Everything that can refuse a request (validation, limits, admission) happens before the
first byte of a response, so a refusal is a status code and never a truncated stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pkv.core.engine.async_engine import AsyncLLM, RequestStream
from pkv.core.engine.input_processor import ContextLengthError, PreparedRequest
from pkv.core.engine.outputs import CompletionOutput, RequestOutput
from pkv.core.lora.adapter import LoRARequest
from pkv.core.sample.sampling_params import SamplingParams
from pkv.core.server.chat_choice import ChoiceShaper
from pkv.core.server.errors import OpenAIError, engine_error, error_body
from pkv.core.server.middleware import request_tenant
from pkv.core.server.protocol import _SamplingFields

logger = logging.getLogger("pkv.server")


@dataclass
class ServerLimits:
    """Per-request limits; each breach is a 400 naming the field."""

    max_n: int = 16
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_length: int = 256
    max_prompts: int = 64  # prompts in one completions request
    max_pooling_inputs: int = 512  # inputs (or documents) in one embeddings / rerank request
    max_cache_salt_length: int = 256

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, least = getattr(self, f.name), 1 if f.name == "max_n" else 0
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{f.name} must be an integer >= {least}, got {value!r}")


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class OpenAIServing:
    """Turns OpenAI request bodies into engine requests; the endpoints subclass it."""

    def __init__(self, async_llm: AsyncLLM, served_model_name: str,
                 limits: ServerLimits) -> None:
        self.llm = async_llm
        self.model_name = served_model_name
        self.limits = limits
        self.tokenizer = async_llm.engine.tokenizer

    def _check_generates(self) -> None:
        """A 400 where this server's model pools (embeddings, scores) instead of writing."""
        task = self.llm.engine.task
        if task != "generate":
            raise OpenAIError(400, f"{self.model_name!r} serves task={task} (/v1/embeddings, "
                              "/v1/rerank, /score), not text generation", "model")

    def _check_common(self, body: _SamplingFields, logprobs: int | None,
                      logprobs_param: str = "logprobs") -> None:
        self._lora_request(body.model)  # an unknown model name is a 404 before anything else
        body.check_supported()
        if not 1 <= body.n <= self.limits.max_n:
            raise OpenAIError(400, f"n must be between 1 and {self.limits.max_n}", "n")
        if body.stream_options is not None and not body.stream:
            raise OpenAIError(400, "stream_options is only allowed with stream: true",
                              "stream_options")
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

    def _params(self, body: _SamplingFields, max_tokens: int | None, logprobs: int | None,
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
            return body.sampling_params(max_tokens, logprobs, structured,
                                        self.llm.engine.sampling_defaults)
        except ValueError as exc:
            # SamplingParams messages start with the field's name.
            message = str(exc)
            name = message.split(" ", 1)[0]
            param = field if "structured outputs" in message else (names or {}).get(name, name)
            if param != name and message.startswith(f"{name} "):  # as the client called it
                message = param + message[len(name):]
            raise OpenAIError(400, message, param) from None

    async def _prepare(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       body: _SamplingFields, param: str, raw: Request,
                       constraint_param: str | None = None) -> PreparedRequest:
        # Tenants (API keys) never share prefix-cache blocks: their name salts every hash.
        tenant = request_tenant(raw.scope)
        salt = body.cache_salt if tenant is None else f"{tenant}:{body.cache_salt or ''}"
        # (the access line names them beside the HTTP request's id)
        raw.scope.setdefault("state", {}).setdefault("engine_request_ids", []).append(request_id)
        try:
            return await self.llm.prepare(request_id, prompt, params, salt,
                                          self._lora_request(body.model))
        except ContextLengthError as exc:
            raise OpenAIError(400, str(exc), param, "context_length_exceeded") from None
        except ValueError as exc:
            first = str(exc).split(" ", 1)[0]
            if "constraint" in str(exc):  # compiling the structured-output constraint failed
                param = constraint_param or body.structured()[1] or param
            elif first in type(body).model_fields:  # engine messages start with the field
                param = first
            raise OpenAIError(400, str(exc), param) from None

    def served_name(self, model: str | None) -> str:
        """The name a response reports: the adapter `model` names, else the base model's
        (as vLLM does; `model` was checked when the request was prepared)."""
        lora = self.llm.engine.lora
        return model if model is not None and lora is not None and model in lora.adapters \
            else self.model_name

    def _lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 for a name nobody serves."""
        if model is None or model == self.model_name:
            return None
        lora = self.llm.engine.lora
        adapter = lora.adapters.get(model) if lora is not None else None
        if adapter is None:
            names = [self.model_name, *(lora.adapters if lora is not None else ())]
            raise OpenAIError(404, f"model {model!r} does not exist; this server serves "
                              f"{', '.join(map(repr, names))}", "model", "model_not_found")
        return LoRARequest(adapter.name, adapter.uid, adapter.path)

    async def collect_all(self, streams: list[RequestStream], raw: Request) -> list[Any]:
        """Every stream's final output; the first failure (or a client gone) stops the rest.
        One watcher asks after the client for all of them: with a task and a timer per stream,
        the event loop's thread took the engine's cores for long enough that a 64-input
        embedding answered 6-12 ms later (medians, 2-vCPU Zen 5)."""
        tasks = [asyncio.ensure_future(_final(s)) for s in streams]
        try:
            await _watch(tasks, raw)
            return [task.result() for task in tasks]
        finally:
            for task, stream in zip(tasks, streams):
                task.cancel()  # a no-op once done; else the generator's cleanup aborts it
                stream.close()

    async def collect(self, stream: RequestStream, raw: Request) -> RequestOutput:
        """Run to the end; abort if the client disconnects while we wait."""
        return (await self.collect_all([stream], raw))[0]


class EngineStreamingResponse(StreamingResponse):
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


class DeltaTracker:
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


async def single_choice_deltas(stream: RequestStream, shaper: ChoiceShaper
                               ) -> AsyncIterator[tuple[RequestOutput, dict[str, Any]]]:
    """A one-choice stream's outputs, each with what is new in its choice (the shaper's
    delta: reasoning_content, content, tool_calls; empty when nothing is)."""
    tracker = DeltaTracker()
    async for output in stream.outputs():
        c = output.outputs[0]
        new = tracker.advance(0, c) is not None
        yield output, shaper.delta(c.text, c.finish_reason is not None) if new else {}


def usage(finals: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: the prompt tokens read from the prefix cache."""
    return usage_counts(sum(len(f.prompt_token_ids) for f in finals),
                        sum(len(c.token_ids) for f in finals for c in f.outputs),
                        sum(max(0, f.num_cached_tokens) for f in finals))


def usage_counts(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage of these counts."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def stream_error(exc: Exception) -> dict:
    """The error event of a stream that already answered 200."""
    known = engine_error(exc)
    if known is None:
        logger.error("a stream failed", exc_info=exc)
        return error_body(500, "internal server error")
    return error_body(known.status, known.message, code=known.code)


async def _final(stream: RequestStream) -> RequestOutput:
    final = None
    async for output in stream.outputs():
        final = output
    if final is None:
        raise RuntimeError("the engine finished a request without an output")
    return final


async def _watch(tasks: list[asyncio.Future], raw: Request) -> None:
    """Until every task is done: the first failure is raised (engine failures reach the
    client through engine_error), and a client gone raises 499."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, timeout=0.25,
                                           return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        if pending and await raw.is_disconnected():
            raise OpenAIError(499, "client disconnected")
