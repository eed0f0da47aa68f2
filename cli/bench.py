"""`pkv bench`: offline throughput (default) and `pkv bench serve` (online, streaming).

Baselines run in the same process, back to back, so ratios survive a noisy machine.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import click
import typer
from rich.console import Console
from typer.core import TyperGroup

from pkv.cli.errors import user_errors
from pkv.cli.http import auth_headers, base_url
from pkv.cli.soak_memory import MAX_WARMUP_MIB

# Tables are wide: keep them readable when output goes to a file or a CI log.
console = Console(width=None if sys.stdout.isatty() else 160)


class _DefaultRun(TyperGroup):
    """`pkv bench [MODEL] ...` means `pkv bench run [MODEL] ...`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = ["run", *args]
        return super().parse_args(ctx, args)


bench_app = typer.Typer(cls=_DefaultRun, no_args_is_help=False, add_completion=False,
                        help="Benchmarks: offline throughput (default) or `serve` (online).")


def _int_list(value: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be integers separated by commas, got {value!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    return values


@bench_app.command("run")
def run(
    model: Annotated[Optional[str], typer.Argument(help="HF folder, .gguf or Hub id (ORG/NAME); default: bundled")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Branch, tag or commit of a Hub id.")] = None,
    gguf_file: Annotated[Optional[str], typer.Option(help="The .gguf to load from a Hub id or folder.")] = None,
    batch: Annotated[str, typer.Option(help="Concurrent sequences; a list (1,16,64) sweeps.")] = "256",
    num_prompts: Annotated[Optional[int], typer.Option(help="Requests (default 2 x batch).")] = None,
    input_len: Annotated[int, typer.Option(help="Prompt tokens (synthetic prompts).")] = 32,
    output_len: Annotated[int, typer.Option(help="New tokens per request.")] = 128,
    shared_prefix_len: Annotated[int, typer.Option(help="Tokens all synthetic prompts share first.")] = 0,
    long_prompt_len: Annotated[int, typer.Option(help="Add one prompt this long once decoding runs (0: none).")] = 0,
    dataset: Annotated[Optional[Path], typer.Option(help="JSONL file of prompts.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for synthetic prompts.")] = 0,
    warmup: Annotated[int, typer.Option(help="Warm-up requests before timing.")] = 4,
    baseline: Annotated[Optional[str], typer.Option(help="Also run: hf or openai.")] = None,
    baseline_batch: Annotated[int, typer.Option(help="Static batch of the hf baseline.")] = 16,
    url: Annotated[Optional[str], typer.Option(help="Server for --baseline openai.")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="PKV_API_KEY", help="Key for --url.")] = None,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16.")] = "auto",
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    kv_cache_memory: Annotated[Optional[str], typer.Option(help="KV pool size, e.g. 2GiB.")] = None,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option(help="Token budget per step.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Longest sequence.")] = None,
    enable_prefix_caching: Annotated[bool, typer.Option(help="Prefix caching.")] = True,
    attention_backend: Annotated[str, typer.Option(help="auto or a name from `pkv plugins`.")] = "auto",
    quantization: Annotated[str, typer.Option(help="auto, none, awq, fp8, gguf.")] = "auto",
    lm_head_quantization: Annotated[str, typer.Option(help="auto, none, int8.")] = "auto",
    awq_activations: Annotated[str, typer.Option(help="AWQ decode activations: float32, int16 or int8.")] = "float32",
    tensor_parallel_size: Annotated[int, typer.Option(help="Ranks to split the model over.")] = 1,
    speculative_config: Annotated[Optional[str], typer.Option(help='Speculative decoding as JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4}.')] = None,
    workload: Annotated[str, typer.Option(help="synthetic (random-token prompts) or repeat (copy a ~300-token passage: where prompt lookup shines).")] = "synthetic",
    lora_modules: Annotated[Optional[list[str]], typer.Option(help="NAME=PATH of a LoRA adapter (repeat the flag); requests use the first, or all with --lora-mix.")] = None,
    lora_mix: Annotated[bool, typer.Option(help="Spread requests evenly over the --lora-modules adapters.")] = False,
    profile: Annotated[bool, typer.Option(help="Time each phase of every step (overhead vs forward).")] = False,
    roofline: Annotated[bool, typer.Option(help="Also measure the float32 GEMM roofline of a step.")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write every figure here.")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="PNG of throughput/latency over a sweep.")] = None,
) -> None:
    """Offline throughput of pkv on one workload, with an optional baseline, same process."""
    with user_errors(console):
        batches = _int_list(batch, "--batch")
        if baseline not in (None, "hf", "openai"):
            raise ValueError(f"--baseline must be hf or openai, got {baseline!r}")
        if baseline == "openai" and not url:
            raise ValueError("--baseline openai needs --url")
        if input_len < 1 or output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        if shared_prefix_len < 0 or long_prompt_len < 0:
            raise ValueError("--shared-prefix-len and --long-prompt-len must be >= 0")
        if workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
        _run_offline(locals() | {"batches": batches})


def _run_offline(o: dict[str, Any]) -> None:
    import psutil

    from pkv.cli import bench_offline as off
    from pkv.cli import bench_report as report
    from pkv.cli.bench_serve import check_server
    from pkv.core.config import EngineConfig
    from pkv.core.llm_engine import LLMEngine
    from pkv.core.sampling_params import SamplingParams

    headers = auth_headers(o["api_key"])
    url = base_url(o["url"]) if o["url"] else ""
    remote_model = check_server(url, headers) if o["baseline"] == "openai" else None
    engine = LLMEngine(EngineConfig(
        model=o["model"], revision=o["revision"], gguf_file=o["gguf_file"], dtype=o["dtype"],
        block_size=o["block_size"],
        kv_cache_memory=o["kv_cache_memory"], max_num_seqs=max(o["batches"]),
        max_num_batched_tokens=o["max_num_batched_tokens"], max_model_len=o["max_model_len"],
        seed=o["seed"], enable_prefix_caching=o["enable_prefix_caching"],
        attention_backend=o["attention_backend"], quantization=o["quantization"],
        lm_head_quantization=o["lm_head_quantization"], awq_activations=o["awq_activations"],
        tensor_parallel_size=o["tensor_parallel_size"],
        speculative_config=o["speculative_config"], **lora_options(o["lora_modules"])))
    lora_requests = add_adapters(engine, o["lora_modules"])
    if not o["lora_mix"]:
        lora_requests = lora_requests[:1]
    tok = engine.tokenizer
    vocab_ids = [i for i in range(tok.vocab_size) if i not in tok.special_token_ids]
    for prompt in off.make_prompts(vocab_ids, o["warmup"], 8, o["seed"] + 1, None, tok.encode):
        engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=4))
    engine.generate_until_done()
    hf_model = None
    if o["baseline"] == "hf":
        from pkv.core.hub import resolve_model
        from pkv.core.model_loader import bundled_model_path

        with console.status("loading the model in transformers"):
            path = (resolve_model(o["model"], o["revision"], o["gguf_file"]) if o["model"]
                    else bundled_model_path())
            hf_model = off.load_hf_model(path, engine.runner.dtype)
    rooflines, peak = {}, None
    if o["roofline"]:
        from pkv.cli.bench_roofline import fma_peak_gflops, measure, measure_prefill

        rooflines = measure(engine.model_config, o["batches"])
        peak = fma_peak_gflops()
    from pkv.cli.cpu_info import cpu_summary

    console.print(f"[bold]CPU[/]: {cpu_summary()}")
    runs = []
    for b in o["batches"]:
        prompts = workload_prompts(engine, o["workload"], o["num_prompts"] or 2 * b, o)
        long_prompt = (off.make_prompts(vocab_ids, 1, o["long_prompt_len"], o["seed"] + 2, None,
                                        tok.encode)[0] if o["long_prompt_len"] else None)
        console.print(f"[bold]batch {b}[/]: {len(prompts)} prompts, ~{o['input_len']} tokens "
                      f"in, {o['output_len']} out, {engine.runner.dtype}, attention "
                      f"{engine.attention_backend}, {engine.runner.num_blocks} KV blocks, "
                      f"weights {engine.quantization or 'float'} "
                      f"{engine.runner.weight_bytes / 2**20:.0f} MiB, process RSS "
                      f"{psutil.Process().memory_info().rss / 2**20:.0f} MiB")
        loras = ([lora_requests[i % len(lora_requests)] for i in range(len(prompts))]
                 if lora_requests else None)
        result = off.run_pkv(engine, prompts, o["output_len"], b, long_prompt, o["profile"],
                             loras)
        if b in rooflines:
            result.roofline_tps = rooflines[b].tokens_per_s
            result.roofline_gflops = rooflines[b].gflops_per_s
            result.fma_peak_gflops = peak
            chunk = engine.max_num_batched_tokens
            result.prefill_roofline_tps = measure_prefill(
                engine.model_config, [len(p) for p in prompts], chunk).tokens_per_s
        other = None
        if hf_model is not None:
            other = off.run_hf(hf_model, prompts, o["output_len"], o["baseline_batch"])
        elif remote_model is not None:
            other = off.run_openai(url, remote_model, headers, prompts, o["output_len"], b)
        runs.append((result, other))
        console.print(report.offline_table([result] + ([other] if other else [])))
        if result.spec_acceptance_rate is not None:
            console.print(f"speculation: {result.spec_acceptance_rate:.1%} of drafts accepted, "
                          f"{result.spec_mean_accepted_len:.2f} tokens per verify")
        if other is not None:
            console.print(f"[bold]pkv / {other.name}: {result.output_tps / other.output_tps:.2f}x"
                          "[/] output tokens/s")
    if len(runs) > 1:
        console.print(report.offline_table([r for run in runs for r in run if r is not None]))
    if o["profile"]:
        console.print(report.profile_table([r for r, _ in runs]))
        console.print(f"decoder path: {decoder_path(engine)}")
    if rooflines:
        console.print(report.roofline_table([r for r, _ in runs]))
        console.print(report.prefill_roofline_table([r for r, _ in runs]))
    if engine.workers is not None:
        ranks = [os.getpid(), *engine.workers.pids]
        console.print("per-rank peak RSS: " + ", ".join(
            f"rank {i} {off.peak_rss(pid) / 2**20:.0f} MiB" for i, pid in enumerate(ranks)))
        engine.shutdown()
    if o["json_path"]:
        report.write_json(o["json_path"], report.offline_json(runs), console)
    if o["plot"]:
        series = {"pkv": [r.output_tps for r, _ in runs]}
        latency = {"pkv": [1000 * r.elapsed_s / max(r.num_steps, 1) for r, _ in runs]}
        if all(other is not None for _, other in runs):
            series[runs[0][1].name] = [other.output_tps for _, other in runs]
        report.plot_sweep(o["plot"], o["batches"], series, "mean step time (ms)", latency,
                          "batch (concurrent sequences)", console)


WORKLOADS = ("synthetic", "repeat")


def lora_options(modules: list[str] | None) -> dict[str, Any]:
    """Engine options that serve `modules` (NAME=PATH): LoRA on, a slot for each, and the
    highest rank among them (read from each adapter_config.json)."""
    if not modules:
        return {}
    import json

    from pkv.core.lora_manager import parse_lora_modules

    ranks = []
    for _, path in parse_lora_modules(modules):
        config = Path(path).expanduser() / "adapter_config.json"
        ranks.append(json.loads(config.read_text()).get("r", 16) if config.is_file() else 16)
    return {"enable_lora": True, "max_loras": len(modules), "max_lora_rank": max(ranks)}


def add_adapters(engine: Any, modules: list[str] | None) -> list[Any]:
    """Load the adapters into `engine`; their LoRARequests, in order."""
    from pkv.core.lora_adapter import LoRARequest
    from pkv.core.lora_manager import parse_lora_modules

    requests = []
    for name, path in parse_lora_modules(modules or []):
        adapter = engine.add_lora(name, path)
        requests.append(LoRARequest(name, adapter.uid, path))
    return requests


def warm_up(engine: Any, lora_request: Any = None) -> None:
    """One short request through `engine` before timing: kernels built, first-call costs
    paid."""
    from pkv.core.sampling_params import SamplingParams

    engine.add_request(None, [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=8),
                       lora_request=lora_request)
    engine.generate_until_done()


def workload_prompts(engine: Any, workload: str, num_prompts: int, o: dict[str, Any]
                     ) -> list[list[int]]:
    """The prompts of one `--workload`: random tokens (or `--dataset`), or copy-a-passage."""
    from pkv.cli import bench_offline as off

    tok = engine.tokenizer
    if workload == "repeat":
        return off.repeat_prompts(tok, num_prompts)
    vocab_ids = [i for i in range(tok.vocab_size) if i not in tok.special_token_ids]
    return off.make_prompts(vocab_ids, num_prompts, o["input_len"], o["seed"], o["dataset"],
                            tok.encode, o["shared_prefix_len"])


@bench_app.command("attention")
def attention(
    batch: Annotated[int, typer.Option(help="Decoding sequences.")] = 64,
    context: Annotated[int, typer.Option(help="Tokens already in each sequence's cache.")] = 512,
    heads: Annotated[int, typer.Option(help="Query heads (SmolLM2: 9).")] = 9,
    kv_heads: Annotated[int, typer.Option(help="KV heads (SmolLM2: 3).")] = 3,
    head_dim: Annotated[int, typer.Option(help="Head size (SmolLM2: 64).")] = 64,
    layers: Annotated[int, typer.Option(help="Layers per step, each with its own K/V cache (SmolLM2: 30).")] = 30,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    repeat: Annotated[int, typer.Option(help="Timed repetitions (best is kept).")] = 5,
    sliding_window: Annotated[Optional[int], typer.Option(help="Attend within this many keys.")] = None,
    soft_cap: Annotated[Optional[float], typer.Option(help="Soft-cap scores (Gemma 2: 50).")] = None,
) -> None:
    """Decode-attention time per engine step for every attention backend usable here."""
    import time

    import torch
    from rich.table import Table

    from pkv.cli.cpu_info import cpu_summary
    from pkv.plugins.attention.layouts import random_paged_layout
    from pkv.plugins.registry import discover, select_attention_backend

    console.print(f"[bold]CPU[/]: {cpu_summary()}")
    with user_errors(console):
        if min(batch, context, heads, kv_heads, head_dim, layers, repeat) < 1:
            raise ValueError("every size must be >= 1")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        registry = discover()
        q, k, v, k_cache, v_cache, meta = random_paged_layout(
            [(context, 1)] * batch, block_size, heads, kv_heads, head_dim, seed=0)
        # One cache per layer, as in a model: at large batches a step's K/V then streams from
        # memory, as it does in the engine, instead of sitting in the CPU's cache. Past 4 GiB
        # of copies the layers take the distinct caches in turn (still far beyond any cache).
        per_layer = 2 * k_cache.numel() * k_cache.element_size()
        distinct = max(1, min(layers, (4 << 30) // per_layer))
        copies = [(k_cache, v_cache)] + [(k_cache.clone(), v_cache.clone())
                                         for _ in range(distinct - 1)]
        caches = [copies[i % distinct] for i in range(layers)]
        times = {}
        for name in registry.usable_attention_backends(device):
            backend = select_attention_backend(name, device, registry)
            best = float("inf")
            for _ in range(repeat + 1):  # the first run warms up
                start = time.perf_counter()
                for kc, vc in caches:
                    backend.forward(q, k, v, kc, vc, meta, head_dim**-0.5,
                                    sliding_window=sliding_window, logits_soft_cap=soft_cap)
                best = min(best, time.perf_counter() - start)
            times[name] = best
        table = Table(title=f"decode attention per step: batch {batch}, context {context}, "
                            f"{heads}/{kv_heads} heads x {head_dim}, {layers} layers, window "
                            f"{sliding_window}, soft-cap {soft_cap}")
        for column in ("backend", "ms per step", "vs torch"):
            table.add_column(column, justify="left" if column == "backend" else "right")
        for name, t in sorted(times.items(), key=lambda kv: kv[1]):
            table.add_row(name, f"{1000 * t:.1f}", f"{times.get('torch', t) / t:.2f}x faster")
        console.print(table)


@bench_app.command("spec")
def spec(
    model: Annotated[Optional[str], typer.Argument(help="HF folder, .gguf or Hub id; default: bundled SmolLM2.")] = None,
    speculative_config: Annotated[str, typer.Option(help='Speculative decoding as JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4}.')] = '{"method": "ngram", "num_speculative_tokens": 4}',
    workload: Annotated[str, typer.Option(help="Workloads, comma-separated: repeat, synthetic.")] = "repeat,synthetic",
    batch: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")] = "1",
    num_prompts: Annotated[Optional[int], typer.Option(help="Requests per run (default: 2 x batch, at least 4).")] = None,
    input_len: Annotated[int, typer.Option(help="Prompt tokens of synthetic prompts.")] = 32,
    output_len: Annotated[int, typer.Option(help="New tokens per request.")] = 128,
    kv_cache_memory: Annotated[str, typer.Option(help="KV pool size of each engine.")] = "1GiB",
    seed: Annotated[int, typer.Option(help="Seed for synthetic prompts.")] = 0,
    profile: Annotated[bool, typer.Option(help="Time the speculating steps by phase (propose / forward / sample).")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write every figure here.")] = None,
) -> None:
    """With and without speculative decoding, back to back: tok/s, speed-up, acceptance,
    and whether the greedy outputs are identical."""
    from pkv.cli import bench_report as report
    from pkv.cli.bench_spec import print_runs, run_pair
    from pkv.cli.cpu_info import cpu_summary
    from pkv.core.config import EngineConfig
    from pkv.core.llm_engine import LLMEngine

    with user_errors(console):
        batches = _int_list(batch, "--batch")
        workloads = [w.strip() for w in workload.split(",") if w.strip()]
        unknown = [w for w in workloads if w not in WORKLOADS]
        if unknown or not workloads:
            raise ValueError(f"--workload takes {', '.join(WORKLOADS)}, got {workload!r}")
        options = dict(model=model, kv_cache_memory=kv_cache_memory, max_num_seqs=max(batches),
                       seed=seed)
        EngineConfig(**options, speculative_config=speculative_config)  # errors before loading
        engines = [LLMEngine(EngineConfig(**options)),
                   LLMEngine(EngineConfig(**options, speculative_config=speculative_config))]
        for engine in engines:
            warm_up(engine)
        console.print(f"[bold]CPU[/]: {cpu_summary()}")
        opts = dict(input_len=input_len, seed=seed, dataset=None, shared_prefix_len=0)
        runs = []
        for w in workloads:
            for b in batches:
                prompts = workload_prompts(engines[0], w, num_prompts or max(4, 2 * b), opts)
                console.print(f"[bold]{w}, batch {b}[/]: {len(prompts)} prompts of "
                              f"~{sum(map(len, prompts)) // len(prompts)} tokens, "
                              f"{output_len} out (ignore_eos), greedy")
                runs.append(run_pair(*engines, w, prompts, output_len, b, profile))
        print_runs(console, runs, speculative_config, profile)
        if json_path:
            report.write_json(json_path, {"speculative_config": speculative_config,
                                          "cpu": cpu_summary(),
                                          "runs": [r.as_json() for r in runs]}, console)


@bench_app.command("lora")
def lora(
    lora_modules: Annotated[list[str], typer.Option(help="NAME=PATH of a PEFT LoRA adapter (repeat the flag).")],
    model: Annotated[Optional[str], typer.Argument(help="The adapters' base model; default: bundled SmolLM2.")] = None,
    batch: Annotated[str, typer.Option(help="Batch sizes, comma-separated (batch 1 uses the first adapter; larger ones all, evenly).")] = "1,64",
    num_prompts: Annotated[Optional[int], typer.Option(help="Requests per run (default: 2 x batch, at least 4).")] = None,
    input_len: Annotated[int, typer.Option(help="Prompt tokens (synthetic prompts).")] = 32,
    output_len: Annotated[int, typer.Option(help="New tokens per request.")] = 128,
    kv_cache_memory: Annotated[str, typer.Option(help="KV pool size of each engine.")] = "1GiB",
    profile: Annotated[bool, typer.Option(help="Time the adapter runs' steps by phase.")] = False,
    rounds: Annotated[int, typer.Option(help="Runs of each configuration, in turn; the fastest is kept.")] = 2,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write every figure here.")] = None,
) -> None:
    """Multi-LoRA throughput against the base model, back to back, and memory per adapter."""
    from pkv.cli import bench_report as report
    from pkv.cli.bench_lora import lora_table, memory_table, run_batch
    from pkv.cli.cpu_info import cpu_summary
    from pkv.core.config import EngineConfig
    from pkv.core.llm_engine import LLMEngine

    with user_errors(console):
        batches = _int_list(batch, "--batch")
        options = dict(model=model, kv_cache_memory=kv_cache_memory, max_num_seqs=max(batches))
        lora_engine = LLMEngine(EngineConfig(**options, **lora_options(lora_modules)))
        requests = add_adapters(lora_engine, lora_modules)
        base = LLMEngine(EngineConfig(**options))
        warm_up(base)
        warm_up(lora_engine, requests[0])
        console.print(f"[bold]CPU[/]: {cpu_summary()}")
        opts = dict(input_len=input_len, seed=0, dataset=None, shared_prefix_len=0)
        runs = []
        for b in batches:
            prompts = workload_prompts(base, "synthetic", num_prompts or max(4, 2 * b), opts)
            console.print(f"[bold]batch {b}[/]: {len(prompts)} prompts, ~{input_len} tokens in, "
                          f"{output_len} out")
            runs.append(run_batch(base, lora_engine, requests, prompts, output_len, b, profile,
                                  max(1, rounds)))
        console.print(lora_table(runs))
        console.print(memory_table(lora_engine))
        if profile:
            console.print(report.profile_table([r.adapters for r in runs]))
        if json_path:
            report.write_json(json_path, {"cpu": cpu_summary(),
                                          "runs": [r.as_json() for r in runs]}, console)


@bench_app.command("compare")
def compare(
    candidate: Annotated[str, typer.Argument(help="The model measured (B): HF folder, .gguf or Hub id, e.g. the output of `pkv quantize --awq`.")],
    baseline_model: Annotated[Optional[str], typer.Option(help="The model it is measured against (A); default: bundled SmolLM2, float32.")] = None,
    batch: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")] = "1,64",
    num_prompts: Annotated[Optional[int], typer.Option(help="Requests per run (default: 2 x batch, at least 4).")] = None,
    input_len: Annotated[int, typer.Option(help="Prompt tokens (synthetic prompts).")] = 32,
    output_len: Annotated[int, typer.Option(help="New tokens per request.")] = 128,
    rounds: Annotated[int, typer.Option(help="Runs of each model per batch size, in turn (A B, B A, ...); the ratio is taken per round.")] = 3,
    kv_cache_memory: Annotated[str, typer.Option(help="KV pool size of each engine.")] = "1GiB",
    awq_activations: Annotated[str, typer.Option(help="The candidate's AWQ decode activations: float32, int16 or int8.")] = "float32",
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write every figure here.")] = None,
) -> None:
    """Two models on the same prompts in one process, in turn: each round's tok/s of both and
    B / A (say, a 4-bit model against the float model it was quantized from)."""
    from pkv.cli import bench_report as report
    from pkv.cli.bench_compare import compare_table, run_rounds
    from pkv.cli.cpu_info import cpu_summary
    from pkv.core.config import EngineConfig
    from pkv.core.llm_engine import LLMEngine

    with user_errors(console):
        batches = _int_list(batch, "--batch")
        if rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {rounds}")
        options = dict(kv_cache_memory=kv_cache_memory, max_num_seqs=max(batches))
        candidate_config = EngineConfig(model=candidate, awq_activations=awq_activations,
                                        **options)  # errors before loading anything
        engines = [LLMEngine(EngineConfig(model=baseline_model, **options)),
                   LLMEngine(candidate_config)]
        vocabs = [e.model_config.vocab_size for e in engines]
        if vocabs[0] != vocabs[1]:
            raise ValueError(f"the two models must share a vocabulary to take the same prompts: "
                             f"{vocabs[0]} vs {vocabs[1]} tokens")
        for engine in engines:
            warm_up(engine)
        console.print(f"[bold]CPU[/]: {cpu_summary()}")
        opts = dict(input_len=input_len, seed=0, dataset=None, shared_prefix_len=0)
        runs = []
        for b in batches:
            prompts = workload_prompts(engines[0], "synthetic", num_prompts or max(4, 2 * b),
                                       opts)
            console.print(f"[bold]batch {b}[/]: {len(prompts)} prompts, ~{input_len} tokens "
                          f"in, {output_len} out, {rounds} round(s)")
            runs.append(run_rounds(*engines, prompts, output_len, b, rounds))
        names = [e.model_name for e in engines]
        console.print(compare_table(runs, *names))
        if json_path:
            report.write_json(json_path, {"cpu": cpu_summary(), "baseline": names[0],
                                          "candidate": names[1],
                                          "runs": [r.as_json() for r in runs]}, console)


@bench_app.command("moe")
def moe(
    batch: Annotated[str, typer.Option(help="Tokens per forward; a list (1,64) sweeps.")] = "1,64",
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = 1024,
    experts: Annotated[int, typer.Option(help="Experts in the layer.")] = 8,
    top_k: Annotated[int, typer.Option(help="Experts per token.")] = 2,
    expert_intermediate: Annotated[int, typer.Option(help="Each expert's width.")] = 512,
    repeat: Annotated[int, typer.Option(help="Timed forwards (the median is kept).")] = 50,
) -> None:
    """One sparse MoE layer vs a dense MLP with the same active parameters (random weights)."""
    from pkv.cli.bench_moe import print_moe_vs_dense

    with user_errors(console):
        print_moe_vs_dense(console, batch_sizes=_int_list(batch, "--batch"), hidden=hidden,
                           num_experts=experts, top_k=top_k,
                           expert_intermediate=expert_intermediate, repeats=repeat)


@bench_app.command("kernels")
def kernels(
    rows: Annotated[str, typer.Option(help="Rows (tokens) per call; a list sweeps.")] = "1,16,64",
    isa: Annotated[str, typer.Option(help="Kernel flavours, comma-separated (avx512, avx2, "
                                          "generic); default: every one this CPU runs.")] = "",
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = 576,
    intermediate: Annotated[int, typer.Option(help="MLP width.")] = 1536,
    qkv: Annotated[int, typer.Option(help="qkv output width: (heads + 2 kv heads) x head "
                                          "size.")] = 960,
    vocab: Annotated[int, typer.Option(help="LM head rows.")] = 49152,
    group: Annotated[int, typer.Option(help="AWQ group size.")] = 64,
    repeat: Annotated[int, typer.Option(help="Timed calls (the median is kept).")] = 20,
    footprint_mib: Annotated[float, typer.Option(help="Weights each kernel rotates through, "
                                                      "so calls read memory, not cache.")] = 96.0,
) -> None:
    """The 4-bit AWQ layer and int8 LM head vs float32, per kernel flavour and row count
    (random weights; defaults: SmolLM2-135M's shape)."""
    from pkv.cli.bench_kernels import KernelShape, print_kernels

    with user_errors(console):
        flavours = [f.strip() for f in isa.split(",") if f.strip()]
        print_kernels(console, KernelShape(hidden, intermediate, qkv, vocab, group),
                      _int_list(rows, "--rows"), flavours, repeats=repeat,
                      footprint_mib=footprint_mib)


@bench_app.command("guided")
def guided(
    model: Annotated[Optional[str], typer.Argument(help="HF folder or .gguf; default: bundled")] = None,
    num_requests: Annotated[int, typer.Option(help="Guided requests across the 5 schemas.")] = 50,
    batch: Annotated[int, typer.Option(help="Batch for guided vs unguided throughput.")] = 32,
    max_tokens: Annotated[int, typer.Option(help="Token limit per request.")] = 128,
    kv_cache_memory: Annotated[str, typer.Option(help="KV pool size.")] = "1GiB",
    backends: Annotated[str, typer.Option(help="Comma-separated guided decoding backends.")] = "outlines,xgrammar",
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write every figure here.")] = None,
) -> None:
    """Structured outputs per backend: keyword-suite coverage, validity over 5 schemas,
    compile time cold and cached, mask cost per step at batch 1 and 32, throughput."""
    from pkv.cli import bench_report as report
    from pkv.cli.bench_guided import backends_table, run_guided_bench
    from pkv.cli.cpu_info import cpu_summary
    from pkv.core.config import EngineConfig
    from pkv.core.llm_engine import LLMEngine

    with user_errors(console):
        if min(num_requests, batch, max_tokens) < 1:
            raise ValueError("--num-requests, --batch and --max-tokens must be >= 1")
        results = {}
        console.print(f"[bold]CPU[/]: {cpu_summary()}")
        for backend in [b.strip() for b in backends.split(",") if b.strip()]:
            engine = LLMEngine(EngineConfig(model=model, kv_cache_memory=kv_cache_memory,
                                            max_model_len=1024, max_num_seqs=max(batch, 64),
                                            guided_decoding_backend=backend))
            results[backend] = run_guided_bench(engine, num_requests, batch, max_tokens,
                                                console)
            engine.shutdown()
        console.print(backends_table(results))
        if json_path:
            report.write_json(json_path, results, console)


@bench_app.command("serve")
def serve(
    url: Annotated[str, typer.Option(help="Base URL of an OpenAI-compatible server.")],
    api_key: Annotated[Optional[str], typer.Option(envvar="PKV_API_KEY", help="Bearer key.")] = None,
    model: Annotated[Optional[str], typer.Option(help="Model name (default: the server's first).")] = None,
    concurrency: Annotated[str, typer.Option(help="Concurrent requests; a list sweeps.")] = "1,16,64",
    num_prompts: Annotated[Optional[int], typer.Option(help="Requests per level (default 2 x concurrency).")] = None,
    input_len: Annotated[int, typer.Option(help="Prompt length (about, in tokens).")] = 32,
    output_len: Annotated[int, typer.Option(help="New tokens per request.")] = 128,
    request_rate: Annotated[float, typer.Option(help="Poisson arrivals per second (inf: all at once).")] = float("inf"),
    seed: Annotated[int, typer.Option(help="Seed for prompts and arrivals.")] = 0,
    slo_ttft_ms: Annotated[Optional[float], typer.Option(help="TTFT goal for goodput.")] = None,
    slo_tpot_ms: Annotated[Optional[float], typer.Option(help="TPOT goal for goodput.")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write every figure here.")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="PNG over the concurrency sweep.")] = None,
) -> None:
    """Online benchmark: streaming chat requests against a running server."""
    from pkv.cli import bench_report as report
    from pkv.cli.bench_serve import check_server, run_level, synthetic_messages

    with user_errors(console):
        levels = _int_list(concurrency, "--concurrency")
        if request_rate <= 0:
            raise ValueError("--request-rate must be > 0 (or inf)")
        url = base_url(url)
        headers = auth_headers(api_key)
        model = model or check_server(url, headers)
        summaries = []
        for level in levels:
            prompts = synthetic_messages(num_prompts or 2 * level, input_len, seed)
            result = asyncio.run(run_level(
                url, model, headers, prompts, output_len, level, request_rate,
                slo_ttft_ms / 1000 if slo_ttft_ms else None,
                slo_tpot_ms / 1000 if slo_tpot_ms else None, seed))
            failed = [r.error for r in result.records if not r.ok]
            if failed:
                console.print(f"[yellow]{len(failed)} requests failed, e.g. {failed[0]}[/]")
            summaries.append(result.summary())
        console.print(report.serve_table(summaries, url))
        if json_path:
            report.write_json(json_path, {"url": url, "model": model, **summaries[-1],
                                          "runs": summaries}, console)
        if plot:
            report.plot_sweep(plot, levels, {"output tok/s": [s["output_throughput"]
                                                              for s in summaries]},
                              "ms", {"TTFT p50": [s["p50_ttft_ms"] for s in summaries],
                                     "TPOT p50": [s["p50_tpot_ms"] for s in summaries]},
                              "concurrency", console)




@bench_app.command("families")
def families(
    family: Annotated[str, typer.Option(help="Families, comma-separated (default: all).")] = "",
    batch: Annotated[str, typer.Option(help="Batch sizes, comma-separated.")] = "1,64",
    output_len: Annotated[int, typer.Option(help="New tokens per request.")] = 32,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write every figure here.")] = None,
) -> None:
    """Decode speed of every model family on random weights of one shape, beside Llama."""
    from pkv.cli import bench_report as report
    from pkv.cli.bench_families import FAMILY_SHAPES, bench_families, families_table
    from pkv.cli.cpu_info import cpu_summary

    with user_errors():
        names = [f.strip() for f in family.split(",") if f.strip()] or list(FAMILY_SHAPES)
        unknown = sorted(set(names) - set(FAMILY_SHAPES))
        if unknown:
            raise ValueError(f"unknown families {unknown}; known: {', '.join(FAMILY_SHAPES)}")
        batches = _int_list(batch, "batch")
        console.print(f"[bold]CPU[/]: {cpu_summary()}")
        rows = bench_families(names, batches, output_len)
    console.print(families_table(rows, batches))
    if json_path:
        report.write_json(json_path, {"cpu": cpu_summary(), "rows": [
            {"family": r.family, "path": r.path,
             "decode_tokens_per_s": {str(b): v for b, v in r.decode_tps.items()}}
            for r in rows]}, console)


@bench_app.command("window")
def window(
    window: Annotated[int, typer.Option(help="Sliding window of every layer, in tokens.")] = 256,
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens.")] = 32,
    output_len: Annotated[int, typer.Option(help="New tokens.")] = 2048,
    every: Annotated[int, typer.Option(help="Sample the block count every this many tokens.")] = 256,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write every figure here.")] = None,
) -> None:
    """KV blocks one long generation holds over time, with a sliding window and without."""
    from pkv.cli import bench_report as report
    from pkv.cli.bench_window import window_table, window_vs_full
    from pkv.cli.cpu_info import cpu_summary

    with user_errors():
        if window < 1 or output_len < every or every < 1:
            raise ValueError("window and every must be >= 1, output_len >= every")
        console.print(f"[bold]CPU[/]: {cpu_summary()}")
        runs = window_vs_full(window, prompt_len, output_len, every)
    console.print(window_table(runs, 16))
    if json_path:
        report.write_json(json_path, {name: {str(k): v for k, v in r.items()}
                                      for name, r in runs.items()}, console)


@bench_app.command("soak")
def soak(
    model: Annotated[Optional[str], typer.Argument(help="HF folder or .gguf; default: bundled")] = None,
    duration: Annotated[float, typer.Option(help="Seconds of load.")] = 600,
    interval: Annotated[float, typer.Option(help="Seconds between memory samples (the server idles for each).")] = 60,
    max_num_seqs: Annotated[int, typer.Option(help="The server's running batch.")] = 32,
    concurrency: Annotated[Optional[int], typer.Option(help="Clients (default 2 x max-num-seqs).")] = None,
    warmup: Annotated[float, typer.Option(help="Seconds of load before the first sample.")] = 0,
    max_model_len: Annotated[int, typer.Option(help="The server's longest sequence.")] = 1024,
    max_slope: Annotated[float, typer.Option(help="MiB per minute memory outside the KV pool may climb after its plateau.")] = 1.0,
    max_peak_mib: Annotated[Optional[float], typer.Option(help="Most MiB memory outside the KV pool may reach (default: no bound).")] = None,
    max_warmup_mib: Annotated[float, typer.Option(help="Most MiB memory outside the KV pool may rise above the idle server's before any load.")] = MAX_WARMUP_MIB,
    seed: Annotated[int, typer.Option(help="Seed of the traffic mix.")] = 0,
    trace: Annotated[bool, typer.Option(help="Trace the server's Python heap (tracemalloc; slower) and list where it grew.")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write every figure here.")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="PNG of memory over time.")] = None,
) -> None:
    """A real server at capacity for `duration` under a hostile mix; fails on unexpected
    errors, held KV blocks, memory that climbs after its plateau, or growing open files."""
    import dataclasses
    import secrets

    from pkv.cli import bench_report as report
    from pkv.cli.bench_soak import (Minute, caches_table, drive, memory_report, memory_table,
                                    minutes_table, state_table, verdict, wait_idle)
    from pkv.core.memory_report import TRACE_ENV
    from pkv.cli.serve_process import start_pkv_serve
    from pkv.cli.soak_memory import MemoryCurve, plot_curve

    with user_errors(console):
        if duration <= 0 or interval <= 0 or warmup < 0 or max_num_seqs < 1 or (
                concurrency is not None and concurrency < 1):
            raise ValueError("--duration, --interval, --max-num-seqs and --concurrency must be "
                             "> 0, --warmup >= 0")
        key = secrets.token_hex(16)
        headers = {"Authorization": f"Bearer {key}"}
        args = ["--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
                "--kv-cache-memory", "256MiB", *([model] if model else [])]
        clients = concurrency or 2 * max_num_seqs
        curve, totals, minutes, reports = MemoryCurve(interval / 60), [], [], []
        env = {TRACE_ENV: "1"} if trace else None
        with start_pkv_serve(args, key, env=env) as (base, pid):
            curve.before_mib = wait_idle(base, headers, pid).rss_without_kv / 2**20
            if warmup:
                asyncio.run(drive(base, headers, clients, warmup, seed + 10**6))
            start = wait_idle(base, headers, pid)
            reports.append(memory_report(base, headers))  # the heap's baseline when traced
            for k in range(max(1, round(duration / interval))):
                m: Minute = asyncio.run(drive(base, headers, clients, interval, seed + k))
                snap = wait_idle(base, headers, pid)
                reports.append(memory_report(base, headers))
                minutes.append(m)
                curve.samples_mib.append(snap.rss_without_kv / 2**20)
                totals.append(snap.rss_bytes / 2**20)
                console.print(f"sample {k + 1}: served {m.served}, aborted {m.aborted}, invalid "
                              f"{m.invalid}, unexpected {len(m.unexpected)}, p99 TTFT "
                              f"{m.p99_ttft_ms:.0f} ms; idle RSS {totals[-1]:.0f} MiB, outside "
                              f"the KV pool {curve.samples_mib[-1]:.0f} MiB")
            end = snap
        console.print(minutes_table(minutes, f"pkv bench soak: {duration:g} s at {clients} "
                                    f"clients, server batch {max_num_seqs}, sampled every "
                                    f"{interval:g} s"))
        console.print(state_table(start, end))
        console.print(memory_table(reports))
        console.print(caches_table(reports[0], reports[-1]))
        for grew in reports[-1]["top_growth"]:
            console.print(f"python heap +{grew['bytes'] / 2**20:.2f} MiB "
                          f"({grew['count']:+d} blocks) at {grew['where']}")
        problems = verdict(minutes, start, end, curve, max_slope, max_peak_mib, max_warmup_mib)
        plateau = curve.plateau_start()
        slope = curve.slope(plateau) if plateau is not None else None
        console.print(f"memory outside the KV pool: {curve.before_mib:.0f} MiB before load, "
                      f"peak {curve.peak:.0f} MiB (+{curve.warmup:.0f}); plateau from "
                      f"sample {plateau + 1 if plateau is not None else '-'}, slope after it "
                      f"{slope if slope is not None else float('nan'):+.2f} MiB/min")
        if plot:
            plot_curve(plot, curve, totals)
            console.print(f"wrote {plot}")
        if json_path:
            report.write_json(json_path, {
                "duration_s": duration, "interval_s": interval,
                "served": sum(m.served for m in minutes),
                "samples": [{**dataclasses.asdict(m), "p99_ttft_ms": m.p99_ttft_ms,
                             "ttfts": len(m.ttfts), "rss_mib": t, "rss_without_kv_mib": r}
                            for m, t, r in zip(minutes, totals, curve.samples_mib)],
                "plateau_sample": plateau, "slope_mib_per_min": slope, "peak_mib": curve.peak,
                "before_load_mib": curve.before_mib, "warmup_mib": curve.warmup,
                "memory_reports": reports,
                "start": dataclasses.asdict(start), "end": dataclasses.asdict(end),
                "problems": problems}, console)
        if problems:
            console.print("[bold red]soak failed[/]: " + "; ".join(problems))
            raise typer.Exit(1)
        console.print(f"[bold green]soak passed[/]: {sum(m.served for m in minutes)} served, "
                      "0 unexpected errors, every KV block back, memory flat after its "
                      "warm-up")

@bench_app.command("burst")
def burst(
    model: Annotated[Optional[str], typer.Argument(help="HF folder or .gguf; default: bundled")] = None,
    clients: Annotated[int, typer.Option(help="Requests sent at the same moment.")] = 200,
    max_num_seqs: Annotated[int, typer.Option(help="The server's running batch.")] = 16,
    max_waiting_requests: Annotated[int, typer.Option(help="The server's queue bound.")] = 32,
    kv_cache_memory: Annotated[str, typer.Option(help="The server's KV pool.")] = "48MiB",
    max_model_len: Annotated[int, typer.Option(help="The server's longest sequence.")] = 1024,
    max_tokens: Annotated[int, typer.Option(help="Tokens each request asks for.")] = 16,
    url: Annotated[Optional[str], typer.Option(help="Burst a running server instead.")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="PKV_API_KEY", help="Its API key.")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write every figure here.")] = None,
) -> None:
    """Every client at once against a server with small limits: answers by status (200, or
    503/429 with Retry-After; never 500) and /health latency during the burst."""
    import secrets
    from contextlib import nullcontext

    from pkv.cli import bench_report as report
    from pkv.cli.bench_burst import burst as send_burst, burst_table
    from pkv.cli.serve_process import start_pkv_serve

    with user_errors(console):
        if clients < 1 or max_num_seqs < 1 or max_waiting_requests < 1 or max_tokens < 1:
            raise ValueError("--clients, --max-num-seqs, --max-waiting-requests and "
                             "--max-tokens must be >= 1")
        key = api_key if url else secrets.token_hex(16)
        args = ["--max-num-seqs", str(max_num_seqs), "--max-waiting-requests",
                str(max_waiting_requests), "--kv-cache-memory", kv_cache_memory,
                "--max-model-len", str(max_model_len),
                *([model] if model else [])]
        body = {"prompt": "Write a short poem about the sea.", "max_tokens": max_tokens,
                "ignore_eos": True}
        server = nullcontext((base_url(url), 0)) if url else start_pkv_serve(args, key or "")
        with server as (base, _):
            result = asyncio.run(send_burst(base, auth_headers(key),
                                            [body, {**body, "stream": True}], clients))
        where = url or (f"max-num-seqs {max_num_seqs}, max-waiting-requests "
                        f"{max_waiting_requests}, KV {kv_cache_memory}")
        console.print(burst_table({"burst": result}, f"pkv bench burst: {clients} clients at "
                                  f"once, half streamed ({where})"))
        problems = result.problems()
        if json_path:
            report.write_json(json_path, {
                "statuses": dict(result.statuses), "stream_errors": result.stream_errors,
                "without_retry_after": result.without_retry_after,
                "transport_errors": result.transport_errors, "examples": result.examples,
                "health_p99_ms": result.health_p99_ms, "health_max_ms": result.health_max_ms,
                "seconds": result.seconds, "problems": problems}, console)
        if problems:
            console.print("[bold red]burst failed[/]: " + "; ".join(problems))
            raise typer.Exit(1)
        console.print("[bold green]burst passed[/]: every answer 200 or an overload refusal "
                      "with Retry-After, /health always up")


@bench_app.command("tools")
def tools(
    model: Annotated[Optional[str], typer.Argument(help="HF folder or .gguf; default: bundled")] = None,
    requests: Annotated[int, typer.Option(help="Forced tool-call requests.")] = 100,
    url: Annotated[Optional[str], typer.Option(help="A running server instead.")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="PKV_API_KEY", help="Its API key.")] = None,
) -> None:
    """Forced tool calls (required, named) against a real server: the share whose every
    call's arguments validate against the function's schema."""
    import secrets
    from contextlib import nullcontext

    import numpy as np

    from pkv.cli.bench_tools import first_model, forced_calls
    from pkv.cli.serve_process import start_pkv_serve

    with user_errors(console):
        if requests < 1:
            raise ValueError("--requests must be >= 1")
        key = api_key if url else secrets.token_hex(16)
        args = ["--max-model-len", "2048", "--kv-cache-memory", "256MiB",
                *([model] if model else [])]
        server = nullcontext((base_url(url), 0)) if url else start_pkv_serve(args, key or "")
        with server as (base, _):
            headers = auth_headers(key)
            run = asyncio.run(forced_calls(base, headers, first_model(base, headers), requests))
        console.print(f"forced tool calls: [bold]{run.valid}/{run.requests}[/] requests with "
                      f"every call valid ({run.calls} calls), median latency "
                      f"{np.median(run.seconds):.2f} s")
        for failure in run.failures[:5]:
            console.print(f"  failed: {failure}", highlight=False)


def decoder_path(engine: Any) -> str:
    """Which code computes the decoder layers: the C++ stack, or the Python loop and why."""
    from pkv.core.fused_decoder import fused_decoder_gaps
    from pkv.plugins.cpp_build import selected_flavour

    model = engine.runner.model
    if model.model.fused is not None:
        return f"fused C++ decoder stack (csrc/decoder_cpu.cpp, {selected_flavour()} kernels)"
    gaps = fused_decoder_gaps(model) or ["linears not on the C++ kernels (dtype, device or "
                                         "weight format)"]
    return f"Python layer loop ({model.config.architecture}: {'; '.join(gaps)})"
