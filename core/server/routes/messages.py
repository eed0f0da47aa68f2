"""Anthropic's Messages API and its token count."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pkv.core.server.anthropic_messages import (AnthropicServingMessages, CountTokensRequest,
                                                MessagesRequest)


def add_routes(app: FastAPI, serving: AnthropicServingMessages) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, raw: Request) -> Response:
        return await serving.messages(body, raw)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: CountTokensRequest) -> dict:
        return await serving.count_tokens(body)

