"""OpenAI's Chat Completions and Completions, and the model list."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pkv.core.engine.llm_engine import LLMEngine
from pkv.core.server.protocol import ChatCompletionRequest, CompletionRequest
from pkv.core.server.serving_chat import OpenAIServingChat
from pkv.core.server.serving_completion import OpenAIServingCompletion


def add_routes(app: FastAPI, chat: OpenAIServingChat, completion: OpenAIServingCompletion,
               engine: LLMEngine, served_model_name: str) -> None:
    created = int(time.time())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.chat(body, raw)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await completion.completion(body, raw)

    @app.get("/v1/models")
    async def models() -> dict:
        base = {"id": served_model_name, "object": "model", "created": created,
                "owned_by": "pkv", "root": engine.config.model or engine.model_name,
                "parent": None, "max_model_len": engine.max_model_len}
        loaded = list((engine.lora.adapters if engine.lora else {}).items())  # (a copy: the
        adapters = [{**base, "id": name, "root": adapter.path,  # engine thread loads them)
                     "parent": served_model_name} for name, adapter in loaded]
        return {"object": "list", "data": [base, *adapters]}

