"""OpenAI's Responses API: create, and a stored response's get, input items, delete, cancel."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pkv.core.server.errors import OpenAIError
from pkv.core.server.responses_api import OpenAIServingResponses
from pkv.core.server.responses_items import ResponsesRequest


def add_routes(app: FastAPI, serving: OpenAIServingResponses) -> None:
    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return await serving.create(body, raw)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, raw: Request, stream: bool = False) -> dict:
        if stream:  # (OpenAI replays a background response's events)
            raise OpenAIError(400, "stream: a stored response is not streamed again; GET it "
                              "whole", "stream")
        return serving.retrieve(response_id, raw)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, raw: Request, limit: int = 20,
                                   order: str = "desc", after: str | None = None,
                                   before: str | None = None) -> dict:
        return serving.input_items(response_id, raw, limit, order, after, before)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw: Request) -> dict:
        return serving.delete(response_id, raw)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, raw: Request) -> dict:
        return serving.cancel(response_id, raw)

