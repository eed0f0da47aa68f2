"""vLLM's tokenizer endpoints: a prompt or a conversation to ids, ids back to text."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from pkv.core.engine.llm_engine import LLMEngine
from pkv.core.server.errors import OpenAIError
from pkv.core.server.protocol import DetokenizeRequest, TokenizeRequest
from pkv.core.server.serving_chat import OpenAIServingChat, check_messages


def add_routes(app: FastAPI, engine: LLMEngine, chat: OpenAIServingChat) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        tokenizer = engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            if not body.messages:
                raise OpenAIError(400, "messages must hold at least one message", "messages")
            check_messages(body.messages)
            ids = await chat.prompt_ids(body.as_chat(), to_generate=False)
        else:
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt or "",
                                          add_special_tokens=body.add_special_tokens)
        strs = ({"token_strs": [tokenizer.id_to_token(t) for t in ids]}
                if body.return_token_strs else {})
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len, **strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        vocab = engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise OpenAIError(400, f"tokens must be in [0, {vocab})", "tokens")
        # Special tokens kept (vLLM's, as transformers' decode): a rendered chat round-trips.
        return JSONResponse({"prompt": engine.tokenizer.decode(body.tokens,
                                                               skip_special_tokens=False)})

