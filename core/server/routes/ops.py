"""What operators and their tools read: health probes, Prometheus metrics, the version, and
the operator's /admin views of the KV cache and memory."""

from __future__ import annotations

import asyncio

import psutil
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from pkv.core.engine.async_engine import AsyncLLM
from pkv.core.server.errors import OpenAIError
from pkv.core.server.memory_report import CacheSize, HeapTracer, engine_caches
from pkv.core.server.metrics import ServerMetrics
from pkv.core.server.responses_api import ResponseStore
from pkv.core.worker.memory import native_heap, resident_by_kind


def add_routes(app: FastAPI, async_llm: AsyncLLM, metrics: ServerMetrics,
               store: ResponseStore, tracer: HeapTracer, version: str) -> None:
    @app.api_route("/health", methods=["GET", "HEAD"])
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's probe)
    async def health() -> Response:
        if async_llm.is_alive:
            return Response(status_code=200)
        raise OpenAIError(503, async_llm.dead_reason or "the engine loop is not running")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version_info() -> dict:
        return {"version": version}

    @app.get("/admin/cache")
    async def admin_cache() -> dict:
        """The KV cache as `pkv inspect-cache` shows it (behind the API key when one is set)."""
        from pkv.core.sched.cache_inspector import take_snapshot

        return (await async_llm.call_in_engine(take_snapshot)).to_dict()

    @app.get("/admin/memory")
    async def admin_memory() -> dict:
        """RSS (anonymous / file-backed), the KV pool's part of it, the weights' bytes by
        storage type (Q4_K, float32, ...), the native heap (glibc's totals), OS threads, every
        cache's size and bound, and the Python heap's growth by line when traced
        (PKV_TRACEMALLOC=1); behind the API key."""
        caches = await async_llm.call_in_engine(engine_caches)
        caches["stored responses"] = CacheSize(len(store), store.capacity, "responses")
        heap = native_heap()
        process = psutil.Process()
        runner = async_llm.engine.runner
        return {"rss_bytes": process.memory_info().rss,
                "kv_resident_bytes": runner.kv_resident_bytes,
                "weight_bytes": runner.weight_bytes,
                "weight_bytes_by_type": runner.weight_bytes_by_type,
                "resident": resident_by_kind(),
                "native_heap": heap.as_dict() if heap else None,
                "threads": process.num_threads(),
                "caches": {name: c.as_dict() for name, c in caches.items()},
                **await asyncio.to_thread(tracer.report)}

