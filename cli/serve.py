"""`pkv serve`: load a model, start the engine loop, serve the OpenAI API with uvicorn.

Options come from defaults < `--config FILE.yaml` < flags given on the command line.
SIGTERM/SIGINT: stop accepting, let in-flight requests finish for `--shutdown-timeout`
seconds, abort the rest, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Iterator
from dataclasses import asdict, fields
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from pkv.cli.errors import user_errors

console = Console(stderr=True)

# The serving recipes installed with pkv (the repository's recipes/, the wheel's pkv/recipes/).
RECIPES = Path(__file__).resolve().parents[1] / "recipes"

# Seconds the requests the engine ended at shutdown have to send their error events.
_STREAM_END_SECONDS = 5
_DEAD_EXIT_SECONDS = 5  # of 503s from a dead engine before the process exits

# Options that configure the HTTP side rather than the engine.
SERVER_OPTIONS = ("host", "port", "api_key", "served_model_name", "log_level",
                  "shutdown_timeout", "allowed_origins", "max_waiting_requests", "step_timeout",
                  "body_timeout", "max_body_bytes", "max_n", "max_logprobs", "max_stop_strings",
                  "max_stop_length", "tool_call_parser", "reasoning_parser", "lora_modules",
                  "enable_runtime_lora", "lora_dir")


def serve(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Argument(help="HF folder, .gguf or Hub id (ORG/NAME); default: bundled SmolLM2.")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Branch, tag or commit of a Hub id.")] = None,
    gguf_file: Annotated[Optional[str], typer.Option(help="The .gguf to load from a Hub id or folder.")] = None,
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(envvar="PKV_API_KEY", help="Require this Bearer key (comma-separated: one per tenant; tenants never share prefix-cache blocks).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="Model name clients use.")] = None,
    task: Annotated[str, typer.Option(help="auto (from the checkpoint), generate, embed (/v1/embeddings) or classify / score (a cross-encoder: /v1/rerank, /score).")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16.")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    kv_cache_dtype: Annotated[str, typer.Option(help="KV cache storage: auto (the compute dtype), float32, bfloat16, float16, int8, fp8_e4m3 (fp8): 8-bit rows hold ~3.8x the tokens of float32.")] = "auto",
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    kv_cache_memory: Annotated[Optional[str], typer.Option(help="KV pool size, e.g. 2GiB.")] = None,
    memory_utilization: Annotated[float, typer.Option(help="Fraction of memory for weights + KV.")] = 0.9,
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences per step.")] = 256,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option(help="Token budget per step.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Longest prompt + output.")] = None,
    enable_prefix_caching: Annotated[bool, typer.Option(help="Reuse KV blocks of shared prefixes.")] = True,
    kv_offload_dir: Annotated[Optional[str], typer.Option(help="Folder for a disk tier of the prefix cache: evicted blocks are saved there and read back on a hit, also after a restart (one server per folder).")] = None,
    kv_offload_size: Annotated[str, typer.Option(help="Most bytes --kv-offload-dir may hold, e.g. 20GiB (least recently used blocks go first).")] = "4GiB",
    tensor_parallel_size: Annotated[int, typer.Option(help="Devices to split the model over.")] = 1,
    pipeline_parallel_size: Annotated[int, typer.Option(help="Pipeline stages: each rank holds a run of layers and their KV (local ranks, or torchrun --nnodes for several machines).")] = 1,
    pp_layer_partition: Annotated[Optional[str], typer.Option(help="Layers per pipeline stage, e.g. 10,12 (default: balanced by bytes).")] = None,
    attention_backend: Annotated[str, typer.Option(help="auto or a name from `pkv plugins`.")] = "auto",
    quantization: Annotated[str, typer.Option(help="auto, none, awq, fp8, gguf.")] = "auto",
    lm_head_quantization: Annotated[str, typer.Option(help="auto (int8 with 4-bit weights on CPU), none, int8.")] = "auto",
    awq_activations: Annotated[str, typer.Option(help="4-bit AWQ / GGUF decode on CPU: float32 (exact), int16 or int8 (integer dot products, faster; int8 the fastest, and the only integer mode of a GGUF's K-quants).")] = "float32",
    guided_decoding_backend: Annotated[str, typer.Option(help="Structured-output backend: auto (per constraint kind), outlines, xgrammar.")] = "auto",
    structured_outputs_timeout: Annotated[float, typer.Option(help="Seconds a constraint may compile.")] = 30.0,
    speculative_config: Annotated[Optional[str], typer.Option(help='Speculative decoding as JSON: {"method": "ngram", "num_speculative_tokens": 4} or {"model": DRAFT, "num_speculative_tokens": 4}.')] = None,
    enable_lora: Annotated[bool, typer.Option(help="Serve LoRA adapters on the base model.")] = False,
    max_loras: Annotated[int, typer.Option(help="Adapters resident at once (slots, LRU).")] = 4,
    max_lora_rank: Annotated[int, typer.Option(help="Highest adapter rank.")] = 16,
    lora_modules: Annotated[Optional[list[str]], typer.Option(help="NAME=PATH of a PEFT LoRA adapter; clients pick it with \"model\": NAME (repeat the flag for more).")] = None,
    enable_runtime_lora: Annotated[bool, typer.Option("--enable-runtime-lora", "--allow-runtime-lora", help="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key).")] = False,
    lora_dir: Annotated[Optional[str], typer.Option(help="Load adapters only from under this folder.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for unseeded requests.")] = 0,
    generation_config: Annotated[str, typer.Option(help="Sampling defaults for unset fields: auto (the model's generation_config.json) or none (OpenAI's).")] = "auto",
    config: Annotated[Optional[Path], typer.Option(help="YAML file, or a shipped recipe's name (smollm2-cpu); any flag as a key.")] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error.")] = "info",
    shutdown_timeout: Annotated[float, typer.Option(help="Grace period on SIGTERM, seconds.")] = 30.0,
    allowed_origins: Annotated[Optional[list[str]], typer.Option(help="CORS origins (none by default).")] = None,
    max_waiting_requests: Annotated[int, typer.Option(help="Queue bound; past it 503.")] = 1024,
    body_timeout: Annotated[float, typer.Option(help="Seconds a request's headers, then its body, may take to arrive (closed, then 408, after).")] = 30.0,
    step_timeout: Annotated[float, typer.Option(help="Seconds one engine step may run before the watchdog declares the engine wedged (/health 503).")] = 120.0,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body.")] = 4 * 2**20,
    max_n: Annotated[int, typer.Option(help="Largest n per request.")] = 16,
    max_logprobs: Annotated[int, typer.Option(help="Largest logprobs/top_logprobs.")] = 20,
    max_stop_strings: Annotated[int, typer.Option(help="Most stop strings per request.")] = 16,
    max_stop_length: Annotated[int, typer.Option(help="Longest stop string.")] = 256,
    tool_call_parser: Annotated[str, typer.Option(help="How `auto` tool calls are read: a parser from `pkv plugins`, or auto (from the chat template).")] = "auto",
    reasoning_parser: Annotated[Optional[str], typer.Option(help="deepseek_r1 or qwen3: <think> blocks go to reasoning_content.")] = None,
    check: Annotated[bool, typer.Option("--check", help="Validate the options and exit, without loading weights.")] = False,
) -> None:
    """Serve a model over the OpenAI API (chat, completions, responses, streaming; embeddings,
    rerank and score for pooling models) and Anthropic's Messages API."""
    with user_errors():
        options = _merge_options(ctx, config)
        if check:
            _check(options)
        else:
            _run(options)


def _merge_options(ctx: typer.Context, config_file: Path | None) -> dict[str, Any]:
    """Defaults, then YAML, then flags that were given explicitly."""
    options = {k: v for k, v in ctx.params.items() if k not in ("config", "check")}
    if config_file is None:
        return options
    for name, value in yaml_options(config_file, set(options)).items():
        # typer vendors click: compare the source by name, not by enum identity.
        if getattr(ctx.get_parameter_source(name), "name", "") != "COMMANDLINE":
            options[name] = value
    return options


def serve_options(config_file: Path | None) -> dict[str, Any]:
    """`pkv serve`'s options as its defaults and `config_file` (YAML or a recipe's name)
    make them, for commands that run the same engine without serving it."""
    import inspect

    options = {name: p.default for name, p in inspect.signature(serve).parameters.items()
               if name not in ("ctx", "config", "check")}
    if config_file is not None:
        options.update(yaml_options(config_file, set(options)))
    return options


def yaml_options(config_file: Path, known: set[str]) -> dict[str, Any]:
    """The options a YAML file (or a shipped recipe) sets, each name one of `known`."""
    import yaml

    from pkv.core.config.engine import VLLM_HINTS

    config_file = _config_path(config_file)
    try:
        loaded = yaml.safe_load(config_file.read_text()) or {}
    except UnicodeDecodeError:
        raise ValueError(f"{config_file} is not a text (UTF-8) file") from None
    except yaml.YAMLError as exc:  # one line: the problem and where, not the file's text
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ValueError(f"{config_file} is not valid YAML: "
                         f"{getattr(exc, 'problem', None) or 'cannot parse'}{where}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{config_file} must hold a mapping of option: value")
    options, types = {}, _option_types()
    for key, value in loaded.items():
        name = str(key).replace("-", "_")
        if name not in known:
            hint = VLLM_HINTS.get(name)  # a vLLM user's option, and what pkv has instead
            raise ValueError(f"unknown option {key!r} in {config_file}"
                             + (f": {hint}" if hint else ""))
        # a list option given one value (`lora_modules: a=/x`) is a list of one, as its flag
        value = [value] if name in _list_options() and isinstance(value, str) else value
        # the engine's options are checked by EngineConfig, port and api_key by their own rules
        typed = name in SERVER_OPTIONS and name not in ("port", "api_key")
        options[name] = _typed(name, value, types[name]) if typed else value
    return options


def _option_types() -> dict[str, Any]:
    """Each `pkv serve` option's type, as its flag parses it (Optional[T] kept)."""
    import typing

    hints = typing.get_type_hints(serve, include_extras=True)
    return {name: typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint
            for name, hint in hints.items()}


def _typed(name: str, value: Any, kind: Any) -> Any:
    """A YAML value of a server option as its flag would have read it; a ValueError naming
    the option where it cannot be (a string for a number, a number for a list, ...)."""
    import typing

    unset = ""
    args = typing.get_args(kind)
    if type(None) in args:  # Optional[T]
        if value is None:
            return None
        kind, unset = next(a for a in args if a is not type(None)), " or unset"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    checks = {bool: (isinstance(value, bool), "true or false"),
              int: (number and isinstance(value, int), "an integer"),
              float: (number, "a number"),
              str: (isinstance(value, str), "a string")}
    if typing.get_origin(kind) is list:
        checks[kind] = (isinstance(value, list) and all(isinstance(v, str) for v in value),
                        "a list of strings")
    if kind not in checks:
        return value
    ok, expected = checks[kind]
    if not ok:
        raise ValueError(f"{name} must be {expected}{unset}, got {value!r}")
    return float(value) if kind is float else value


def _list_options() -> set[str]:
    """The options `pkv serve` takes as lists (its flags given more than once)."""
    import inspect

    return {name for name, p in inspect.signature(serve).parameters.items()
            if "list[" in str(p.annotation)}


def _config_path(value: Path) -> Path:
    """A YAML file, or the name of a recipe that ships with pkv (`--config smollm2-cpu`)."""
    if value.is_file():
        return value
    if value.is_dir():
        raise ValueError(f"config file {value} is a folder; name a YAML file in it")
    recipe = RECIPES / f"{value.name.removesuffix('.yaml')}.yaml"
    if value.parent == Path(".") and recipe.is_file():
        return recipe
    shipped = ", ".join(sorted(p.stem for p in RECIPES.glob("*.yaml"))) or "none"
    raise FileNotFoundError(f"config file {value} does not exist, nor is it a recipe that ships "
                            f"with pkv ({shipped})")


def _engine_config(options: dict[str, Any]) -> Any:
    from pkv.core.config.engine import EngineConfig

    engine_keys = {f.name for f in fields(EngineConfig)}
    return EngineConfig.from_dict({k: v for k, v in options.items() if k in engine_keys})


def _server_config(options: dict[str, Any]) -> Any:
    """The HTTP side's settings, validated as they are built (before any weights load; the
    served name, when not given, is the model's, set once it has loaded)."""
    from pkv.core.server.api_server import ServerConfig
    from pkv.core.server.serving_engine import ServerLimits

    port = options["port"]
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
    if not 0 <= options["shutdown_timeout"] < float("inf"):
        raise ValueError("shutdown_timeout must be a finite number of seconds >= 0, got "
                         f"{options['shutdown_timeout']}")
    if options["log_level"].lower() not in ("debug", "info", "warning", "error", "critical"):
        raise ValueError(f"log_level must be debug, info, warning or error, got "
                         f"{options['log_level']!r}")
    _check_parsers(options)
    return ServerConfig(
        served_model_name=options["served_model_name"] or "",
        api_key=options["api_key"], max_body_bytes=options["max_body_bytes"],
        max_waiting_requests=options["max_waiting_requests"],
        step_timeout=options["step_timeout"], body_timeout=options["body_timeout"],
        allowed_origins=list(options["allowed_origins"] or []),
        tool_call_parser=options["tool_call_parser"], reasoning_parser=options["reasoning_parser"],
        limits=ServerLimits(options["max_n"], options["max_logprobs"],
                            options["max_stop_strings"], options["max_stop_length"]),
        enable_runtime_lora=options["enable_runtime_lora"], lora_dir=options["lora_dir"])


def _check_parsers(options: dict[str, Any]) -> None:
    """The reasoning and tool call parsers named exist (before any weights load)."""
    from pkv.core.registry import discover
    from pkv.core.structured_output.reasoning import reasoning_parser

    reasoning_parser(options["reasoning_parser"])
    parsers = discover().tool_parsers
    if options["tool_call_parser"] != "auto" and options["tool_call_parser"] not in parsers:
        raise ValueError(f"unknown tool call parser {options['tool_call_parser']!r}; choose "
                         f"auto or one of {', '.join(sorted(parsers))}")


def _check(options: dict[str, Any]) -> None:
    """Validate every option, and the model's config and tokenizer where the path exists
    here; never load weights."""
    from pkv.core.model_loader.loader import open_model

    config = _engine_config(options)
    _lora_modules(options)
    _server_config(options)
    from pkv.core.registry import check_attention_backend, discover, select_guided_backend

    registry = discover()
    select_guided_backend(config.guided_decoding_backend, registry)
    check_attention_backend(config.attention_backend, registry)
    from pkv.core.model_loader.hub import on_this_machine

    if config.model is None or on_this_machine(config.model, config.revision, config.gguf_file):
        from pkv.core.model_loader.quantization import resolve_weight_loader
        from pkv.core.worker.model_setup import check_model, resolve_max_model_len

        source = open_model(config.model, revision=config.revision,
                            gguf_file=config.gguf_file)
        check_model(config, source)
        resolve_weight_loader(config.quantization, source, registry)
        resolve_max_model_len(config, source.config.max_position_embeddings)
        model = f"{source.name} ({source.config.architecture}, read without weights)"
        spec = config.speculative
        if spec is not None and spec.model and Path(spec.model).expanduser().exists():
            from pkv.core.spec_decode.draft_proposer import check_draft_vocab

            check_draft_vocab(spec, open_model(spec.model).config.vocab_size,
                              source.config.vocab_size)
    else:
        model = f"{config.model} (not on this machine; checked again when serving)"
    console.print(f"[bold green]config OK[/]: model {escape(model)}, tensor_parallel_size "
                  f"{config.tensor_parallel_size}, pipeline_parallel_size "
                  f"{config.pipeline_parallel_size}, quantization {config.quantization}",
                  highlight=False, soft_wrap=True)


def _lora_modules(options: dict[str, Any]) -> list[tuple[str, str]]:
    """--lora-modules NAME=PATH pairs, checked against --enable-lora and --lora-dir."""
    from pkv.core.lora.manager import parse_lora_modules
    from pkv.core.server.routes.adapters import check_lora_dir

    pairs = parse_lora_modules(options["lora_modules"] or [])
    for _, path in pairs:
        check_lora_dir(path, options["lora_dir"])
    if (pairs or options["enable_runtime_lora"]) and not options["enable_lora"]:
        raise ValueError("--lora-modules and --enable-runtime-lora need --enable-lora")
    return pairs


def _run(options: dict[str, Any]) -> None:
    logging.basicConfig(level=options["log_level"].upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pkv.core.worker.tp_worker import torchrun_worker
    from pkv.core.worker.workers import launched_by_torchrun

    if launched_by_torchrun() and os.environ["RANK"] != "0":
        # rank 0 serves HTTP; the others compute with it
        torchrun_worker(asdict(_engine_config(options)))
        return
    _server_config(options)  # (a bad port is a one-line error before the socket's)
    sock = _listening_socket(options["host"], options["port"])
    async_llm, app, server_config = start_app(options)
    _print_summary(async_llm.engine, server_config, options)
    try:
        _serve_until_signal(app, options, async_llm, sock)
    finally:
        dead = async_llm.dead_reason
        async_llm.shutdown()
    if dead is not None:  # a supervisor restarts it on this exit (compose, systemd, k8s)
        Console(stderr=True).print(f"[bold red]error:[/] the engine stopped: {escape(dead)}",
                                   highlight=False, soft_wrap=True)
        raise typer.Exit(code=1)
    console.print("[bold]pkv stopped[/]")


def _listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use or a host that is
    not this machine's is a one-line error at once, not uvicorn's after the loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not left 0: connections accepted from it carry the listening socket's
    # protocol number, and asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets
    # that name TCP. With Nagle on, a response written as headers then body waited for the
    # client's delayed ACK on a kept-alive connection: ~40 ms on every request of an SDK client.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:  # in use, not an address here, not a host name at all
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def start_app(options: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(AsyncLLM, the app on it, ServerConfig) for `options`, the engine built on its own
    thread and its loop running: the caller shuts it down."""
    from pkv.core.engine.async_engine import AsyncLLM
    from pkv.core.engine.engine_thread import EngineThread
    from pkv.core.engine.llm_engine import LLMEngine
    from pkv.core.server.api_server import build_app

    config = _engine_config(options)
    adapters = _lora_modules(options)
    server_config = _server_config(options)
    lora_dir = options["lora_dir"]
    if lora_dir is not None and not Path(lora_dir).expanduser().is_dir():
        raise ValueError(f"--lora-dir {lora_dir} is not a folder on this machine")

    def build() -> LLMEngine:
        engine = LLMEngine(config)
        for name, path in adapters:
            engine.add_lora(name, path)
        return engine

    thread = EngineThread()  # builds the engine and steps it: engine_thread.py says why
    engine = thread.call(build)
    server_config.served_model_name = server_config.served_model_name or engine.model_name
    async_llm = AsyncLLM(engine, server_config.max_waiting_requests,
                         step_timeout=server_config.step_timeout, thread=thread)
    app = build_app(async_llm, server_config)
    async_llm.start()
    return async_llm, app, server_config


def _print_summary(engine: Any, server: Any, options: dict[str, Any]) -> None:
    from pkv.core.worker.kv_pool_size import blocks_per_seq

    cfg, runner = engine.model_config, engine.runner
    kv_gib = engine.kv_cache_bytes / 2**30
    # (every KV group's blocks: a windowed group's as well as the global layers')
    per_seq = blocks_per_seq(engine.config, runner.kv_groups, engine.max_model_len)
    table = Table.grid(padding=(0, 2))
    rows = [("model", f"{server.served_model_name} ({cfg.architecture}, "
                      f"{cfg.num_parameters / 1e6:.1f} M parameters)"),
            ("dtype / device", f"{str(runner.dtype).removeprefix('torch.')} on {runner.device}, "
                               f"attention: {engine.attention_backend}, "
                               f"weights: {engine.quantization or 'float'}"),
            ("KV cache", f"{runner.num_blocks} blocks x {engine.config.block_size} tokens = "
                         f"{kv_gib:.2f} GiB, {runner.kv_format.name}"),
            ("max concurrency", f"{engine.config.max_num_seqs} sequences; "
                                f"{runner.num_blocks / per_seq:.1f}x at max_model_len "
                                f"{engine.max_model_len}"),
            ("auth", "Bearer key required" if server.api_key else _open_auth(options["host"])),
            ("LoRA", ", ".join(engine.lora.adapters) or "enabled, no adapters yet"
             if engine.lora is not None else "off"),
            ("url", f"http://{options['host']}:{options['port']}/v1")]
    for key, value in rows:
        table.add_row(f"[bold]{key}[/]", value)
    console.print(Panel(table, title="pkv serve", expand=False))


def _open_auth(host: str) -> str:
    """The auth line of a server without a key: fine on loopback, a warning elsewhere."""
    import ipaddress

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = False
    return ("none (loopback only)" if loopback else
            f"[bold red]none, and bound to {escape(host)}: anyone who reaches it can use it "
            "(set --api-key)[/]")


def _serve_until_signal(app: Any, options: dict[str, Any], async_llm: Any,
                        sock: socket.socket) -> None:
    import uvicorn

    from pkv.core.server.http_protocol import head_deadline_protocol

    grace = options["shutdown_timeout"]

    class _Server(uvicorn.Server):
        dead_ticks = 0  # uvicorn's ticks (0.1 s) since the engine died
        # uvicorn re-raises SIGTERM after its shutdown (exit by signal); we exit 0 instead.
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            def handle(signum: int, frame: Any) -> None:
                if self.should_exit:  # a second signal: end what runs now
                    async_llm.stop()
                self.force_exit = self.should_exit
                self.should_exit = True

            previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)

        async def on_tick(self, counter: int) -> bool:
            # A dead engine (its loop failed, a rank died, a step wedged) serves nothing
            # again: after a few seconds of 503s the process exits non-zero, since compose's
            # and systemd's restarts act on an exit, not on /health.
            if async_llm.dead_reason is not None:
                self.dead_ticks += 1
                if self.dead_ticks > 10 * _DEAD_EXIT_SECONDS:
                    return True
            return await super().on_tick(counter)

        async def shutdown(self, sockets: Any = None) -> None:
            # At the grace period's end the engine stops, so each request still running ends
            # in its API's error event; uvicorn's own deadline, later, would cancel them
            # mid-chunk (a cut stream and a traceback each).
            deadline = asyncio.get_running_loop().call_later(grace, async_llm.stop)
            try:
                await super().shutdown(sockets)
            finally:
                deadline.cancel()

    config = uvicorn.Config(app, host=options["host"], port=options["port"],
                            log_level=options["log_level"], access_log=False,
                            timeout_graceful_shutdown=int(grace) + _STREAM_END_SECONDS,
                            h11_max_incomplete_event_size=64 * 1024,
                            http=head_deadline_protocol(options["body_timeout"]))
    asyncio.run(_Server(config).serve(sockets=[sock]))
