"""`pkv bench`: offline throughput of the engine, and the same workload through baselines.

Every request decodes exactly `--output-len` tokens (ignore_eos), greedy, so engines do the
same work. Ratios are computed between runs of one process, back to back.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import psutil
import typer
from rich.console import Console
from rich.table import Table

from pkv.cli.errors import user_errors

# Tables are wide: keep them readable when output goes to a file or a CI log.
console = Console(width=None if sys.stdout.isatty() else 150)


@dataclass
class BenchResult:
    """What one engine did with the workload."""

    name: str
    num_requests: int
    elapsed_s: float
    input_tokens: int
    output_tokens: int
    num_steps: int = 0
    peak_blocks: int = 0
    kv_allocated_bytes: int = 0  # at the peak: blocks in use x block bytes
    kv_filled_bytes: int = 0  # at the peak: tokens actually held x token bytes
    peak_rss_bytes: int = 0

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def fragmentation(self) -> float:
        if not self.kv_allocated_bytes:
            return 0.0
        return 1 - self.kv_filled_bytes / self.kv_allocated_bytes


def make_prompts(vocab_ids: list[int], num_prompts: int, input_len: int, seed: int,
                 dataset: Path | None, tokenize) -> list[list[int]]:  # noqa: ANN001
    """Random token prompts (default) or a JSONL file of {"prompt": ...} lines, as token ids."""
    if dataset is not None:
        if not dataset.is_file():
            raise FileNotFoundError(f"dataset {dataset} does not exist")
        lines = [json.loads(line) for line in dataset.read_text().splitlines() if line.strip()]
        texts = [entry["prompt"] if isinstance(entry, dict) else str(entry) for entry in lines]
        if not texts:
            raise ValueError(f"dataset {dataset} has no prompts")
        return [tokenize(texts[i % len(texts)]) for i in range(num_prompts)]
    rng = random.Random(seed)
    return [[rng.choice(vocab_ids) for _ in range(input_len)] for _ in range(num_prompts)]


def run_pkv(engine, prompts: list[list[int]], output_len: int) -> BenchResult:  # noqa: ANN001
    from pkv.core.progress import make_progress
    from pkv.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    result = BenchResult("pkv", len(prompts), 0.0, sum(map(len, prompts)), 0)
    per_token = engine.runner.kv_bytes_per_block // engine.config.block_size
    process = psutil.Process()
    with make_progress() as progress:
        task = progress.add_task("pkv", total=len(prompts) * output_len, info="")
        start = time.perf_counter()
        for prompt in prompts:
            engine.add_request(None, prompt, params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            result.num_steps += 1
            used = engine.kv_cache.pool.num_used_blocks
            if used > result.peak_blocks:
                held = sum(r.num_computed_tokens for r in engine.scheduler.running)
                result.peak_blocks = used
                result.kv_allocated_bytes = used * engine.runner.kv_bytes_per_block
                result.kv_filled_bytes = held * per_token
            result.output_tokens += sum(1 for o in outputs for _ in o.outputs)
            progress.update(task, completed=result.output_tokens,
                            info=f"{engine.get_stats().num_running} running")
            if result.num_steps % 16 == 0:
                result.peak_rss_bytes = max(result.peak_rss_bytes, process.memory_info().rss)
        result.elapsed_s = time.perf_counter() - start
    result.peak_rss_bytes = max(result.peak_rss_bytes, process.memory_info().rss)
    return result


def run_hf(model_path: Path, prompts: list[list[int]], output_len: int, batch: int,
           dtype) -> BenchResult:  # noqa: ANN001
    """transformers `generate`, static batches, left padding, greedy, exactly output_len."""
    import torch
    from transformers import AutoModelForCausalLM

    from pkv.core.progress import make_progress

    with console.status("Loading the model in transformers"):
        if model_path.is_dir():
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path.parent,
                                                         gguf_file=model_path.name, dtype=dtype)
    model.eval()
    result = BenchResult(f"hf (batch {batch})", len(prompts), 0.0, sum(map(len, prompts)), 0)
    process = psutil.Process()
    with make_progress() as progress:
        task = progress.add_task("transformers", total=len(prompts) * output_len, info="")
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len,
                                     min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            result.output_tokens += (out.shape[1] - width) * len(chunk)
            result.num_steps += output_len
            progress.update(task, completed=result.output_tokens)
            result.peak_rss_bytes = max(result.peak_rss_bytes, process.memory_info().rss)
        result.elapsed_s = time.perf_counter() - start
    return result


def print_results(results: list[BenchResult]) -> None:
    table = Table(title="pkv bench: offline throughput")
    for column in ("engine", "req/s", "out tok/s", "all tok/s", "step ms", "KV blocks",
                   "KV alloc", "KV filled", "KV waste", "peak RSS"):
        table.add_column(column, justify="right" if column != "engine" else "left")
    mib = lambda b: f"{b / 2**20:,.0f} MiB" if b else "-"
    for r in results:
        table.add_row(r.name, f"{r.num_requests / r.elapsed_s:.2f}", f"{r.output_tps:.1f}",
                      f"{(r.input_tokens + r.output_tokens) / r.elapsed_s:.1f}",
                      f"{1000 * r.elapsed_s / max(r.num_steps, 1):.1f}",
                      str(r.peak_blocks or "-"), mib(r.kv_allocated_bytes),
                      mib(r.kv_filled_bytes), f"{100 * r.fragmentation:.1f}%"
                      if r.kv_allocated_bytes else "-", mib(r.peak_rss_bytes))
    console.print(table)
    for other in results[1:]:
        console.print(f"[bold]pkv / {other.name}: {results[0].output_tps / other.output_tps:.2f}x"
                      "[/] output tokens/s")


def bench(
    model: Annotated[Optional[str], typer.Argument(help="HF folder or .gguf; default: bundled")] = None,
    batch: Annotated[int, typer.Option(help="Concurrent sequences (max_num_seqs).")] = 256,
    num_prompts: Annotated[Optional[int], typer.Option(help="Requests (default 2 x batch).")] = None,
    input_len: Annotated[int, typer.Option(help="Prompt tokens (synthetic prompts).")] = 32,
    output_len: Annotated[int, typer.Option(help="New tokens per request.")] = 128,
    dataset: Annotated[Optional[Path], typer.Option(help="JSONL file of prompts.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for synthetic prompts.")] = 0,
    warmup: Annotated[int, typer.Option(help="Warm-up requests before timing.")] = 4,
    baseline: Annotated[Optional[str], typer.Option(help="Also run: hf.")] = None,
    baseline_batch: Annotated[int, typer.Option(help="Static batch of the hf baseline.")] = 16,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16.")] = "auto",
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    kv_cache_memory: Annotated[Optional[str], typer.Option(help="KV pool size, e.g. 2GiB.")] = None,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option(help="Token budget per step.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Longest sequence.")] = None,
    enable_prefix_caching: Annotated[bool, typer.Option(help="Prefix caching.")] = True,
) -> None:
    """Measure pkv (and optionally transformers) on the same prompts, in one process."""
    with user_errors(console):
        if baseline not in (None, "hf"):
            raise ValueError(f"--baseline must be hf, got {baseline!r}")
        from pkv.core.config import EngineConfig
        from pkv.core.llm_engine import LLMEngine
        from pkv.core.sampling_params import SamplingParams

        config = EngineConfig(model=model, dtype=dtype, block_size=block_size,
                              kv_cache_memory=kv_cache_memory, max_num_seqs=batch,
                              max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_model_len, seed=seed,
                              enable_prefix_caching=enable_prefix_caching)
        engine = LLMEngine(config)
        tokenizer = engine.tokenizer
        vocab_ids = [i for i in range(tokenizer.vocab_size) if i not in tokenizer.special_token_ids]
        prompts = make_prompts(vocab_ids, num_prompts or 2 * batch, input_len, seed, dataset,
                               tokenizer.encode)
        for prompt in prompts[:warmup]:
            engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=4))
        engine.generate_until_done()
        console.print(f"[bold]{len(prompts)} prompts[/], ~{input_len} tokens in, {output_len} "
                      f"out, batch {batch}, dtype {engine.runner.dtype}, "
                      f"{engine.runner.num_blocks} KV blocks")
        results = [run_pkv(engine, prompts, output_len)]
        if baseline == "hf":
            path = Path(model) if model else _bundled()
            results.append(run_hf(path, prompts, output_len, baseline_batch, engine.runner.dtype))
        print_results(results)


def _bundled() -> Path:
    from pkv.core.model_loader import bundled_model_path

    return bundled_model_path()
