"""OpenAIServingCompletion: `POST /v1/completions`, streamed (SSE) or not: several prompts
in one request, each `n` times, echo and logprobs of the text.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pkv.core.engine.async_engine import RequestStream
from pkv.core.engine.outputs import RequestOutput
from pkv.core.server import logprobs_format as lpf
from pkv.core.server.errors import OpenAIError
from pkv.core.server.protocol import CompletionRequest
from pkv.core.server.serving_engine import (DeltaTracker, EngineStreamingResponse, OpenAIServing,
                                            sse, stream_error, usage)


class OpenAIServingCompletion(OpenAIServing):
    """Text completions: prompts (text or token ids) in, text choices out."""

    async def completion(self, body: CompletionRequest, raw: Request
                         ) -> JSONResponse | StreamingResponse:
        self._check_common(body, body.logprobs)
        # echo_only runs one step (the prompt's logprobs come with it) and drops its token
        max_tokens = 1 if body.echo_only else body.max_tokens
        params = self._params(body, max_tokens if max_tokens is not None else 16, body.logprobs)
        prompts = _prompt_list(body.prompt)
        if len(prompts) * body.n > self.limits.max_prompts:
            raise OpenAIError(400, f"at most {self.limits.max_prompts} prompts (times n) per "
                              "request", "prompt")
        # A full queue refuses before the prompts' tokenizing, not after it (submit checks
        # again: this is the early answer, not the guard)
        self.llm.check_admission(len(prompts) * body.n)
        base_id = f"cmpl-{uuid.uuid4().hex}"
        prepared = [await self._prepare(f"{base_id}-{i}", p, params, body, "prompt", raw)
                    for i, p in enumerate(prompts)]
        streams = self.llm.submit(prepared)
        if body.stream:
            return EngineStreamingResponse(self._completion_stream(body, base_id, streams),
                                            streams)
        finals = await self.collect_all(streams, raw)
        if body.echo_only:
            finals = [_prompt_only(f) for f in finals]
        choices = []
        for i, final in enumerate(finals):
            prefix = self._prompt_text(final) if body.echo else ""
            for c in final.outputs:
                choices.append({"index": i * body.n + c.index, "text": prefix + c.text,
                                "logprobs": self._logprobs(body, final, c.logprobs,
                                                           c.token_ids, prefix),
                                "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason,
                                **self._prompt_field(body, final)})
        return JSONResponse({"id": base_id, "object": "text_completion",
                             "created": int(time.time()), "model": self.served_name(body.model),
                             "choices": choices, "usage": usage(finals)})

    def _logprobs(self, body: CompletionRequest, final: RequestOutput, entries: list | None,
                  token_ids: list[int], echo: str, offset: int = 0) -> dict | None:
        """A choice's logprobs (None: not asked); an echoed prompt's first (`echo`: its text,
        or "" where this part does not carry it). `offset`: the characters of the choice
        before these tokens (a stream's earlier chunks)."""
        if body.logprobs is None or entries is None:
            return None
        if not echo or final.prompt_logprobs is None:
            return lpf.completion(entries, token_ids, body.logprobs, offset + len(echo))
        first = self.tokenizer.decode(final.prompt_token_ids[:1], skip_special_tokens=False)
        prompt = lpf.completion_prompt(final.prompt_logprobs, final.prompt_token_ids, first,
                                       body.logprobs)
        # One run of offsets over the tokens' strings, as vLLM's (the echoed text may spell
        # a token otherwise: a character split over byte tokens)
        after = prompt["text_offset"][-1] + len(prompt["tokens"][-1])
        return lpf.joined(prompt, lpf.completion(entries, token_ids, body.logprobs, after))

    @staticmethod
    def _prompt_field(body: CompletionRequest, final: RequestOutput) -> dict:
        """vLLM's `prompt_logprobs` on a choice, where the request named it."""
        if body.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": lpf.vllm_prompt(final.prompt_logprobs)}

    async def _completion_stream(self, body: CompletionRequest, base_id: str,
                                 streams: list[RequestStream]) -> AsyncIterator[bytes]:
        base = {"id": base_id, "object": "text_completion", "created": int(time.time()),
                "model": self.served_name(body.model)}
        tracker = DeltaTracker()
        finals: dict[int, RequestOutput] = {}
        offsets: dict[int, int] = {}  # per choice: where its next token's text_offset starts
        try:
            async for i, output in _merge([s.outputs() for s in streams]):
                if body.echo_only:
                    output = _prompt_only(output)
                finals[i] = output
                for c in output.outputs:
                    index = i * body.n + c.index
                    first = tracker.is_new(index)
                    echo = self._prompt_text(output) if body.echo and first else ""
                    delta = tracker.advance(index, c)
                    if delta is None:
                        continue
                    text, lps, ids = delta
                    logprobs = self._logprobs(body, output, lps, ids, echo,
                                              offsets.get(index, 0))
                    if logprobs is not None and logprobs["tokens"]:
                        offsets[index] = logprobs["text_offset"][-1] + len(
                            logprobs["tokens"][-1])
                    yield sse({**base, "choices": [{
                        "index": index, "text": echo + text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                        **(self._prompt_field(body, output) if first else {})}],
                        **({"usage": usage(list(finals.values()))} if body.continuous_usage
                           else {})})
        except Exception as exc:
            yield sse(stream_error(exc))
        else:
            if body.include_usage:
                yield sse({**base, "choices": [], "usage": usage(list(finals.values()))})
        yield sse("[DONE]")

    def _prompt_text(self, output: RequestOutput) -> str:
        # A prompt of token ids echoes every one of them, special tokens too (vLLM's)
        return output.prompt if output.prompt is not None else self.tokenizer.decode(
            output.prompt_token_ids, skip_special_tokens=False)


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]
                 ) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]  # type: ignore[list-item]
    if not prompt:
        raise OpenAIError(400, "prompt must not be empty", "prompt")
    return list(prompt)  # type: ignore[arg-type]


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


def _prompt_only(output: RequestOutput) -> RequestOutput:
    """An echo_only request's output: its choices' generated token dropped."""
    choices = [replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None
                       else None) for c in output.outputs]
    return replace(output, outputs=choices)
