"""The FastAPI app: the routes of every API (core/server/routes/), its middleware, and the
server's settings (`ServerConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import FastAPI

from pkv.core.engine.async_engine import AsyncLLM
from pkv.core.registry import select_tool_parser
from pkv.core.server.anthropic_messages import AnthropicServingMessages
from pkv.core.server.errors import install_error_handlers
from pkv.core.server.memory_report import HeapTracer
from pkv.core.server.metrics import ServerMetrics
from pkv.core.server.middleware import (AuthMiddleware, BodyLimitMiddleware,
                                        EndpointCounterMiddleware, RequestIdMiddleware,
                                        split_keys)
from pkv.core.server.responses_api import OpenAIServingResponses
from pkv.core.server.routes import adapters, chat, messages, ops, pooling, responses, tokens
from pkv.core.server.serving_chat import OpenAIServingChat
from pkv.core.server.serving_completion import OpenAIServingCompletion
from pkv.core.server.serving_engine import ServerLimits
from pkv.core.server.serving_pooling import OpenAIServingPooling
from pkv.core.structured_output.reasoning import reasoning_parser
from pkv.core.version import pkv_version

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


def build_app(async_llm: AsyncLLM, config: ServerConfig) -> FastAPI:
    """An app serving `async_llm`; the caller starts and stops the engine loop."""
    app = FastAPI(title="pkv", version=PKV_VERSION, docs_url=None, redoc_url=None)
    metrics = ServerMetrics(async_llm.engine)
    async_llm.on_request_finished = metrics.observe
    async_llm.on_token_interval = metrics.itl.observe
    engine = async_llm.engine
    name = config.served_model_name
    serving_chat = OpenAIServingChat(async_llm, name, config.limits,
                                     select_tool_parser(config.tool_call_parser,
                                                        engine.tokenizer.template_for(True)),
                                     reasoning_parser(config.reasoning_parser))
    serving_responses = OpenAIServingResponses(serving_chat)
    tracer = HeapTracer()
    tracer.start()
    install_error_handlers(app)
    chat.add_routes(app, serving_chat, OpenAIServingCompletion(async_llm, name, config.limits),
                    engine, name)
    responses.add_routes(app, serving_responses)
    messages.add_routes(app, AnthropicServingMessages(serving_chat))
    pooling.add_routes(app, OpenAIServingPooling(async_llm, name, config.limits))
    adapters.add_routes(app, async_llm, name, config.enable_runtime_lora, config.lora_dir)
    tokens.add_routes(app, engine, serving_chat)
    ops.add_routes(app, async_llm, metrics, serving_responses.store, tracer, PKV_VERSION)
    _add_middleware(app, config, metrics)
    return app


def _add_middleware(app: FastAPI, config: ServerConfig, metrics: ServerMetrics) -> None:
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
