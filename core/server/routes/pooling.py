"""Pooling models: embeddings (OpenAI's), rerank (Jina's and Cohere's shape), score and
classify (vLLM's)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pkv.core.server.protocol import (ClassificationRequest, EmbeddingRequest, RerankRequest,
                                      ScoreRequest)
from pkv.core.server.serving_pooling import OpenAIServingPooling, json_body


def add_routes(app: FastAPI, serving: OpenAIServingPooling) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        # Written here, not by FastAPI, whose encoder walks every float of a returned dict
        # (~0.1 s for 64 vectors of 384).
        return Response(json_body(await serving.embeddings(body, raw)),
                        media_type="application/json")

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest, raw: Request) -> dict:
        return await serving.rerank(body, raw)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(body: ClassificationRequest, raw: Request) -> dict:
        return await serving.classify(body, raw)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest, raw: Request) -> dict:
        return await serving.score(body, raw)

