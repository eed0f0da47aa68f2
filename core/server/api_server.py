"""The FastAPI app: OpenAI-compatible routes, health, metrics, tokenizer endpoints."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pkv.core.engine.async_engine import AsyncLLM
from pkv.core.engine.llm_engine import LLMEngine
from pkv.core.registry import select_tool_parser
from pkv.core.server.anthropic_messages import (AnthropicServingMessages, CountTokensRequest,
                                                MessagesRequest)
from pkv.core.server.responses_api import OpenAIServingResponses
from pkv.core.server.responses_items import ResponsesRequest
from pkv.core.server.errors import OpenAIError, install_error_handlers
from pkv.core.server.memory_report import CacheSize, HeapTracer, engine_caches
from pkv.core.server.metrics import ServerMetrics
from pkv.core.server.middleware import (AuthMiddleware, BodyLimitMiddleware,
                                        EndpointCounterMiddleware, RequestIdMiddleware,
                                        split_keys)
from pkv.core.server.protocol import (ChatCompletionRequest, ClassificationRequest,
                                      CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                      LoadLoRAAdapterRequest, RerankRequest, ScoreRequest,
                                      TokenizeRequest, UnloadLoRAAdapterRequest)
from pkv.core.server.serving_chat import OpenAIServingChat, check_messages
from pkv.core.server.serving_completion import OpenAIServingCompletion
from pkv.core.server.serving_engine import ServerLimits
from pkv.core.server.serving_pooling import OpenAIServingPooling, json_body
from pkv.core.structured_output.reasoning import reasoning_parser
from pkv.core.version import pkv_version
from pkv.core.worker.memory import native_heap, resident_by_kind

PKV_VERSION = pkv_version()


@dataclass
class ServerConfig:
    """HTTP-side settings (engine settings live in EngineConfig)."""

    served_model_name: str
    api_key: str | None = None  # comma-separated: one key per tenant
    max_body_bytes: int = 4 * 2**20
    body_timeout: float = 30.0  # seconds for a request body to arrive in full
    max_waiting_requests: int = 1024
    step_timeout: float = 120.0  # seconds before the watchdog calls a step wedged
    allowed_origins: list[str] = field(default_factory=list)
    tool_call_parser: str = "auto"  # a registered parser, or auto (from the chat template)
    reasoning_parser: str | None = None  # deepseek_r1, qwen3
    limits: ServerLimits = field(default_factory=ServerLimits)
    enable_runtime_lora: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    lora_dir: str | None = None  # adapters load only from under this folder (when set)

    def __post_init__(self) -> None:
        # A key list with no key in it would leave the server open while saying it is not.
        if self.api_key is not None and (not isinstance(self.api_key, str)
                                         or not split_keys(self.api_key)):
            # (its type named, never its value: a key is never written to a log)
            got = ("no key" if isinstance(self.api_key, str)
                   else f"a {type(self.api_key).__name__}; quote it in YAML")
            raise ValueError(f"api_key must hold at least one key (k1,k2,...), got {got}")
        for name, value in (("max_body_bytes", self.max_body_bytes),
                            ("max_waiting_requests", self.max_waiting_requests)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, seconds in (("body_timeout", self.body_timeout),
                              ("step_timeout", self.step_timeout)):
            if not seconds > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {seconds!r}")


def check_lora_dir(path: str, lora_dir: str | None) -> None:
    """With `lora_dir` set, adapters load only from under it (links resolved first)."""
    if lora_dir is None:
        return
    root = Path(lora_dir).expanduser().resolve()
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_relative_to(root):
        raise ValueError(f"lora_path {path} is outside the allowed --lora-dir {root}")
    if not resolved.exists():  # (else an `org/name` would go on to the Hugging Face Hub)
        raise ValueError(f"lora_path {path} is not in --lora-dir {root}: with --lora-dir, "
                         "adapters load from that folder only")


def _check_runtime_lora(config: ServerConfig, engine: LLMEngine) -> None:
    if not config.enable_runtime_lora or engine.lora is None:
        raise OpenAIError(400, "loading LoRA adapters at runtime is off: start pkv serve with "
                          "--enable-lora --enable-runtime-lora", "lora_name")


def build_app(async_llm: AsyncLLM, config: ServerConfig) -> FastAPI:
    """An app serving `async_llm`; the caller starts and stops the engine loop."""
    app = FastAPI(title="pkv", version=PKV_VERSION, docs_url=None, redoc_url=None)
    metrics = ServerMetrics(async_llm.engine)
    async_llm.on_request_finished = metrics.observe
    async_llm.on_token_interval = metrics.itl.observe
    engine = async_llm.engine
    serving_chat = OpenAIServingChat(async_llm, config.served_model_name, config.limits,
                                     select_tool_parser(config.tool_call_parser,
                                                        engine.tokenizer.template_for(True)),
                                     reasoning_parser(config.reasoning_parser))
    serving_completion = OpenAIServingCompletion(async_llm, config.served_model_name,
                                                 config.limits)
    serving_messages = AnthropicServingMessages(serving_chat)
    serving_responses = OpenAIServingResponses(serving_chat)
    serving_pooling = OpenAIServingPooling(async_llm, config.served_model_name, config.limits)
    created = int(time.time())
    tracer = HeapTracer()
    tracer.start()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving_chat.chat(body, raw)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return await serving_responses.create(body, raw)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, raw: Request, stream: bool = False) -> dict:
        if stream:  # (OpenAI replays a background response's events)
            raise OpenAIError(400, "stream: a stored response is not streamed again; GET it "
                              "whole", "stream")
        return serving_responses.retrieve(response_id, raw)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, raw: Request, limit: int = 20,
                                   order: str = "desc", after: str | None = None,
                                   before: str | None = None) -> dict:
        return serving_responses.input_items(response_id, raw, limit, order, after, before)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw: Request) -> dict:
        return serving_responses.delete(response_id, raw)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, raw: Request) -> dict:
        return serving_responses.cancel(response_id, raw)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, raw: Request) -> Response:
        return await serving_messages.messages(body, raw)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: CountTokensRequest) -> dict:
        return await serving_messages.count_tokens(body)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        # Written here, not by FastAPI, whose encoder walks every float of a returned dict
        # (~0.1 s for 64 vectors of 384).
        return Response(json_body(await serving_pooling.embeddings(body, raw)),
                        media_type="application/json")

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest, raw: Request) -> dict:
        return await serving_pooling.rerank(body, raw)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(body: ClassificationRequest, raw: Request) -> dict:
        return await serving_pooling.classify(body, raw)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest, raw: Request) -> dict:
        return await serving_pooling.score(body, raw)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving_completion.completion(body, raw)

    @app.get("/v1/models")
    async def models() -> dict:
        base = {"id": config.served_model_name, "object": "model", "created": created,
                "owned_by": "pkv", "root": engine.config.model or engine.model_name,
                "parent": None,
                "max_model_len": engine.max_model_len}
        loaded = list((engine.lora.adapters if engine.lora else {}).items())  # (a copy: the
        adapters = [{**base, "id": name, "root": adapter.path,  # engine thread loads them)
                     "parent": config.served_model_name} for name, adapter in loaded]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        _check_runtime_lora(config, engine)
        if body.lora_name == config.served_model_name:
            raise OpenAIError(400, "lora_name must differ from the base model's name",
                              "lora_name")
        try:
            check_lora_dir(body.lora_path, config.lora_dir)
            # On the engine thread, between steps: a worker thread of its own would start an
            # OpenMP pool of its own, and the engine's steps slow down (engine_thread.py).
            await async_llm.call_in_engine(lambda e: e.add_lora(body.lora_name, body.lora_path))
        except ValueError as exc:
            param = "lora_name" if "already loaded" in str(exc) else "lora_path"
            raise OpenAIError(400, str(exc), param) from None
        return PlainTextResponse(f"loaded LoRA adapter {body.lora_name}")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        _check_runtime_lora(config, engine)
        try:  # on the engine thread, as loads: requests resolve adapters there
            await async_llm.call_in_engine(lambda e: e.remove_lora(body.lora_name))
        except ValueError as exc:
            raise OpenAIError(404, str(exc), "lora_name", "model_not_found") from None
        return PlainTextResponse(f"unloaded LoRA adapter {body.lora_name}")

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
        store = serving_responses.store
        caches["stored responses"] = CacheSize(len(store), store.capacity, "responses")
        heap = native_heap()
        process = psutil.Process()
        return {"rss_bytes": process.memory_info().rss,
                "kv_resident_bytes": engine.runner.kv_resident_bytes,
                "weight_bytes": engine.runner.weight_bytes,
                "weight_bytes_by_type": engine.runner.weight_bytes_by_type,
                "resident": resident_by_kind(),
                "native_heap": heap.as_dict() if heap else None,
                "threads": process.num_threads(),
                "caches": {name: c.as_dict() for name, c in caches.items()},
                **await asyncio.to_thread(tracer.report)}

    @app.get("/version")
    async def version() -> dict:
        return {"version": PKV_VERSION}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        tokenizer = engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            if not body.messages:
                raise OpenAIError(400, "messages must hold at least one message", "messages")
            check_messages(body.messages)
            ids = await serving_chat.prompt_ids(body.as_chat(), to_generate=False)
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

    # The last added is outermost: body limit, then CORS (preflights carry no key), then auth.
    if split_keys(config.api_key):
        app.add_middleware(AuthMiddleware, api_keys=split_keys(config.api_key))
    if config.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes,
                       body_timeout=config.body_timeout)
    routes = frozenset(r.path for r in app.routes if "{" not in getattr(r, "path", "{"))
    app.add_middleware(EndpointCounterMiddleware, endpoints=routes,
                       count=lambda endpoint, status: metrics.http.labels(endpoint,
                                                                          str(status)).inc())
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer carries its id
    return app
