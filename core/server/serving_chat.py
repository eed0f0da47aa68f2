"""OpenAIServingChat: `POST /v1/chat/completions`, streamed (SSE) or not: the model's chat
template rendered under limits, tools planned and parsed, reasoning split out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from pkv.core.engine.async_engine import AsyncLLM, RequestStream
from pkv.core.engine.input_processor import PreparedRequest
from pkv.core.sample.sampling_params import SamplingParams
from pkv.core.server import logprobs_format as lpf
from pkv.core.server.chat_choice import ChoiceShaper
from pkv.core.server.errors import OpenAIError
from pkv.core.server.protocol import ChatCompletionRequest, ChatMessage
from pkv.core.server.serving_engine import (DeltaTracker, EngineStreamingResponse, OpenAIServing,
                                            ServerLimits, sse, stream_error, usage,
                                            usage_counts)
from pkv.core.server.tools import (ToolPlan, check_tool_messages, plan_tools, template_knows_tools,
                                   template_messages)
from pkv.core.structured_output.params import StructuredOutputsParams
from pkv.core.structured_output.reasoning import EFFORT_BUDGETS
from pkv.core.structured_output.reasoning import END as REASONING_END
from pkv.core.structured_output.reasoning import START as REASONING_START
from pkv.core.structured_output.reasoning import ReasoningParser
from pkv.core.structured_output.tool_calls import ToolParser
from pkv.core.tokenizer.chat_messages import check_template_kwargs

MAX_TEMPLATE_KWARGS_BYTES = 64 * 2**10
TEMPLATE_TIMEOUT_S = 5.0
MAX_RENDERED_CHARS = 8 * 2**20


class OpenAIServingChat(OpenAIServing):
    """Chat completions: messages through the template, tool calls and reasoning out."""

    def __init__(self, async_llm: AsyncLLM, served_model_name: str, limits: ServerLimits,
                 tool_parser: ToolParser | None = None,
                 reasoning_parser: ReasoningParser | None = None) -> None:
        super().__init__(async_llm, served_model_name, limits)
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser

    async def chat(self, body: ChatCompletionRequest, raw: Request
                   ) -> JSONResponse | StreamingResponse:
        prepared, stream, shapers = await self.start(body, raw)
        top = (body.top_logprobs or 0) if body.logprobs else None
        if body.stream:
            return EngineStreamingResponse(self._chat_stream(body, prepared, stream, shapers),
                                            [stream])
        final = await self.collect(stream, raw)
        choices = []
        for c in final.outputs:
            message, finish = shapers[c.index].message(c.text, c.finish_reason)
            choices.append({"index": c.index, "message": message,
                            "logprobs": lpf.chat(c.logprobs, c.token_ids, top or 0)
                            if body.logprobs else None, "finish_reason": finish,
                            "stop_reason": c.stop_reason})
        prompt = ({} if body.prompt_logprobs is None  # vLLM's, beside the choices
                  else {"prompt_logprobs": lpf.vllm_prompt(final.prompt_logprobs)})
        return JSONResponse({"id": prepared.request_id, "object": "chat.completion",
                             "created": int(time.time()), "model": self.served_name(body.model),
                             "choices": choices, "usage": usage([final]), **prompt})

    async def start(self, body: ChatCompletionRequest, raw: Request
                    ) -> tuple[PreparedRequest, RequestStream, list[ChoiceShaper]]:
        """Render, validate and queue a chat request: its engine request, the stream of its
        outputs and a shaper per choice (other APIs built on chat share this)."""
        self._check_generates()
        self.llm.check_admission(body.n)  # (a full queue refuses before the rendering)
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
        params.skip_special_tokens = plan.skip_special_tokens and body.skip_special_tokens
        self._cap_thinking(body, params)
        prompt_ids = await self._prompt_ids(body, plan)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        prepared = await self._prepare(request_id, prompt_ids, params, body, "messages", raw,
                                       "tools" if plan.schema is not None else None)
        # Queued (all or none) before any response starts: a full queue or a stopped engine
        # is a 503 (engine_error), never an error inside a started response.
        [stream] = self.llm.submit([prepared])
        return prepared, stream, [ChoiceShaper(plan.extractor, self.reasoning_parser)
                                  for _ in prepared.children]

    async def prompt_ids(self, body: ChatCompletionRequest, to_generate: bool = True
                         ) -> list[int]:
        """The token ids a chat request's conversation (tools included) is rendered to,
        without queuing it; 404 for a model this server does not serve, 400 for a pooling
        model where the ids are `to_generate` from (/tokenize counts them for any model)."""
        self._lora_request(body.model)
        if to_generate:
            self._check_generates()
        return await self._prompt_ids(body, plan_tools(body, self.tool_parser))

    async def _prompt_ids(self, body: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
        # Off the event loop, as the render: a long conversation takes long enough to stall
        # every stream this server sends meanwhile.
        await asyncio.to_thread(self._check_tools_fit, plan)
        text = await self._render_chat(body, plan.tools)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False)

    def _cap_thinking(self, body: ChatCompletionRequest, params: SamplingParams) -> None:
        """`thinking_token_budget`, or `reasoning_effort`'s budget, as the end-of-thinking
        tokens the engine writes once the block reaches it (core/sched/thinking_budget.py)."""
        budget = body.thinking_token_budget
        if budget is not None and self.reasoning_parser is None:
            raise OpenAIError(400, "thinking_token_budget needs a server started with "
                              "--reasoning-parser", "thinking_token_budget")
        if budget is not None and budget < 0:
            raise OpenAIError(400, f"thinking_token_budget must be >= 0, got {budget}",
                              "thinking_token_budget")
        if budget is None and body.reasoning_effort is not None and self.reasoning_parser:
            budget = EFFORT_BUDGETS.get(body.reasoning_effort)  # (max: none)
        if budget is None or self.reasoning_parser is None or not self._thinks(body):
            # (an effort without a reasoning parser, or with thinking switched off in the
            # template, has nothing to cap: the budget's tokens would land in the answer)
            return
        encode = self.tokenizer.encode
        params.thinking_token_budget = budget
        params.think_start_token_ids = ([] if self.reasoning_parser.implicit_start
                                        else encode(REASONING_START, add_special_tokens=False))
        params.think_end_token_ids = encode(REASONING_END, add_special_tokens=False)

    def _template_kwargs(self, body: ChatCompletionRequest) -> dict[str, Any]:
        """The request's template variables (chat_template_kwargs, and reasoning_effort where
        the template reads it: gpt-oss's): those the template never reads are dropped, as
        vLLM drops them; pkv's own are refused."""
        kwargs = dict(body.chat_template_kwargs or {})
        try:
            check_template_kwargs(kwargs)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "chat_template_kwargs") from None
        if len(json.dumps(kwargs)) > MAX_TEMPLATE_KWARGS_BYTES:
            raise OpenAIError(400, f"chat_template_kwargs: at most "
                              f"{MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON", "chat_template_kwargs")
        reads = self.tokenizer.template_variables()
        if body.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        return {key: value for key, value in kwargs.items() if key in reads}

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
                "created": int(time.time()), "model": self.served_name(body.model)}
        running = ({"usage": usage_counts(len(prepared.children[0].prompt_token_ids), 0)}
                   if body.continuous_usage else {})
        for i in range(len(shapers)):
            yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                   "content": ""},
                                             "logprobs": None, "finish_reason": None}],
                       **running})
        tracker = DeltaTracker()
        final = None
        prompt: dict = {}  # vLLM's prompt_logprobs, on the first chunk that can carry them
        try:
            async for output in stream.outputs():
                if final is None and body.prompt_logprobs is not None:
                    prompt = {"prompt_logprobs": lpf.vllm_prompt(output.prompt_logprobs)}
                final = output
                if body.continuous_usage:
                    running = {"usage": usage([output])}
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
                    yield sse({**base, "choices": [{"index": c.index, "delta": delta,
                                                     "logprobs": logprobs,
                                                     "finish_reason": finish,
                                                     "stop_reason": c.stop_reason}],
                               **prompt, **running})
                    prompt = {}
        except Exception as exc:
            yield sse(stream_error(exc))
        else:
            if body.include_usage and final is not None:
                yield sse({**base, "choices": [], "usage": usage([final])})
        yield sse("[DONE]")

    async def _render_chat(self, body: ChatCompletionRequest,
                           tools: list[dict] | None = None) -> str:
        """The server's own template, sandboxed by jinja, off the event loop, with a time
        and a size limit; requests may pass only allow-listed template variables."""
        if body.chat_template is not None:
            raise OpenAIError(400, "requests may not supply a chat template; the server uses "
                              "the model's own", "chat_template")
        kwargs = self._template_kwargs(body)
        check_messages(body.messages)
        if body.continue_final_message and body.add_generation_prompt:
            raise OpenAIError(400, "continue_final_message needs add_generation_prompt=false: "
                              "the model goes on writing the last message, it opens no new "
                              "one", "continue_final_message")
        tools = tools or []
        template = self.tokenizer.template_for(bool(tools))
        messages = template_messages([m.as_template_dict() for m in body.messages], tools,
                                     template)
        if tools and template_knows_tools(template):
            kwargs = {**kwargs, "tools": tools}
        try:
            text = await asyncio.wait_for(asyncio.to_thread(
                self.tokenizer.apply_chat_template, messages, body.add_generation_prompt,
                body.continue_final_message, **kwargs), timeout=TEMPLATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise OpenAIError(400, f"the chat template took over {TEMPLATE_TIMEOUT_S:.0f} s to "
                              "render these messages", "messages") from None
        except Exception as exc:  # jinja errors from the model's own template
            raise OpenAIError(400, f"cannot apply the chat template: {exc}", "messages") from None
        if len(text) > MAX_RENDERED_CHARS:
            raise OpenAIError(400, f"the rendered conversation exceeds {MAX_RENDERED_CHARS} "
                              "characters", "messages")
        return text


def chat_request_from(fields: dict[str, Any], renames: dict[str, str] | None = None
                      ) -> ChatCompletionRequest:
    """The chat request another API (Responses, Messages) builds from its own body; a value
    chat refuses is a 400 naming the field as that API calls it (`renames`: chat's name ->
    the API's)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ()))
        param = (renames or {}).get(field.split(".")[0], field)
        raise OpenAIError(400, f"{param}: {first.get('msg')}", param or None) from None


def named_as(exc: OpenAIError, renames: dict[str, str]) -> OpenAIError:
    """A chat request's error about a field another API (Responses, Messages) calls by
    another name (`renames`: chat's name -> the API's), naming it that way: its param, and
    the message that opens with it."""
    name = renames.get(exc.param or "")
    if name is not None:
        if exc.message.startswith(f"{exc.param} "):
            exc.message = name + exc.message[len(exc.param or ""):]
        exc.param = name
    return exc


def check_messages(messages: list[ChatMessage]) -> None:
    """A 400 naming the first message that has no content where OpenAI requires it, or
    whose tool calls or tool result are malformed."""
    check_tool_messages(messages)
    for i, message in enumerate(messages):
        if message.missing_content():
            raise OpenAIError(400, f"messages[{i}]: a {message.role} message needs content (a "
                              "string or a list of content parts), not null",
                              f"messages[{i}].content")
        part = message.first_bad_part()
        if part is not None:
            raise OpenAIError(400, f"messages[{i}].content[{part}]: expected a text part "
                              '({"type": "text", "text": "..."}); pkv serves text-only models',
                              f"messages[{i}].content")
