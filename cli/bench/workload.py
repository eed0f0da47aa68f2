"""The offline workload of `pkv bench`: its prompts (`--workload`, `--dataset`), and the same
prompts through pkv, transformers, or an OpenAI-compatible server. Every request decodes
exactly `output_len` tokens, greedy."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from pkv.core.progress import make_progress
from pkv.core.sched.cache_inspector import filled_slots


@dataclass
class BenchResult:
    """What one engine did with the workload."""

    name: str
    batch: int
    num_requests: int
    elapsed_s: float
    input_tokens: int
    output_tokens: int
    num_steps: int = 0
    peak_blocks: int = 0
    kv_allocated_bytes: int = 0  # at the peak: blocks in use x block bytes
    kv_filled_bytes: int = 0  # at the peak: tokens actually held x token bytes
    peak_rss_bytes: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    mean_ttft_s: float = 0.0
    max_itl_s: float = 0.0  # worst gap between two tokens of one request
    decode_tokens: int = 0  # tokens of steps that prefilled nothing
    decode_s: float = 0.0  # and those steps' time
    profile_ms: dict[str, float] | None = None  # mean ms per step by phase (--profile)
    roofline_tps: float | None = None  # the GEMM roofline at this batch (--roofline)
    roofline_gflops: float | None = None  # the rate of that roofline's GEMMs
    fma_peak_gflops: float | None = None  # this CPU's float32 multiply-add peak (--roofline)
    prefill_s: float = 0.0  # time of the steps that prefilled something
    prefill_roofline_tps: float | None = None  # of this workload's prefill (--roofline)
    spec_acceptance_rate: float | None = None  # drafts accepted / proposed (speculation)
    spec_mean_accepted_len: float | None = None  # tokens per verify: accepted drafts + 1
    token_ids: list[list[int]] = field(default_factory=list, repr=False)  # per prompt

    @property
    def decode_tps(self) -> float:
        """Aggregate throughput of decode-only steps (prefill excluded)."""
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def roofline_pct(self) -> float | None:
        return 100 * self.decode_tps / self.roofline_tps if self.roofline_tps else None

    @property
    def gemm_peak_pct(self) -> float | None:
        """The roofline's GEMMs as a share of the CPU's multiply-add peak."""
        if not self.roofline_gflops or not self.fma_peak_gflops:
            return None
        return 100 * self.roofline_gflops / self.fma_peak_gflops

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens computed per second of the steps that prefilled (decode tokens those
        steps carried included in the time: a pure prefill has none)."""
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def prefill_roofline_pct(self) -> float | None:
        if not self.prefill_roofline_tps:
            return None
        return 100 * self.prefill_tps / self.prefill_roofline_tps

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def fragmentation_pct(self) -> float:
        if not self.kv_allocated_bytes:
            return 0.0
        return 100 * (1 - self.kv_filled_bytes / self.kv_allocated_bytes)

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "batch": self.batch, "num_requests": self.num_requests,
                "elapsed_s": self.elapsed_s, "output_throughput": self.output_tps,
                "total_throughput": (self.input_tokens + self.output_tokens) / self.elapsed_s,
                "request_throughput": self.num_requests / self.elapsed_s,
                # (None where the engine's steps were not counted: a baseline's)
                "mean_step_ms": (1000 * self.elapsed_s / self.num_steps if self.num_steps
                                 else None),
                "peak_kv_blocks": self.peak_blocks, "kv_allocated_bytes": self.kv_allocated_bytes,
                "kv_filled_bytes": self.kv_filled_bytes,
                "kv_fragmentation_pct": self.fragmentation_pct,
                "peak_rss_bytes": self.peak_rss_bytes, "prefill_tokens": self.prefill_tokens,
                "mean_ttft_ms": 1000 * self.mean_ttft_s, "max_itl_ms": 1000 * self.max_itl_s,
                "decode_throughput": self.decode_tps,
                "profile_ms_per_step": self.profile_ms, "roofline_tokens_per_s": self.roofline_tps,
                "roofline_pct": self.roofline_pct, "roofline_gflops": self.roofline_gflops,
                "fma_peak_gflops": self.fma_peak_gflops, "gemm_peak_pct": self.gemm_peak_pct,
                "prefill_throughput": self.prefill_tps,
                "prefill_roofline_tokens_per_s": self.prefill_roofline_tps,
                "prefill_roofline_pct": self.prefill_roofline_pct,
                "spec_acceptance_rate": self.spec_acceptance_rate,
                "spec_mean_accepted_length": self.spec_mean_accepted_len}


def make_prompts(vocab_ids: list[int], num_prompts: int, input_len: int, seed: int,
                 dataset: Path | None, tokenize: Callable[[str], list[int]],
                 shared_prefix_len: int = 0) -> list[list[int]]:
    """Random token prompts (default; optionally all starting with the same
    `shared_prefix_len` tokens) or a JSONL file of {"prompt": ...} lines, as token ids."""
    if dataset is not None:
        if not dataset.is_file():
            raise FileNotFoundError(f"dataset {dataset} does not exist")
        try:
            lines = [json.loads(line) for line in dataset.read_text().splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValueError(f"dataset {dataset} is not JSONL: {exc}") from None
        texts = [e["prompt"] if isinstance(e, dict) and "prompt" in e else str(e) for e in lines]
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str) or not t), None)
        if bad is not None:
            raise ValueError(f"dataset {dataset} line {bad + 1}: the prompt must be a non-empty "
                             f"string, got {texts[bad]!r}")
        if not texts:
            raise ValueError(f"dataset {dataset} has no prompts")
        return [tokenize(texts[i % len(texts)]) for i in range(num_prompts)]
    rng = random.Random(seed)
    prefix = [rng.choice(vocab_ids) for _ in range(shared_prefix_len)]
    return [prefix + [rng.choice(vocab_ids) for _ in range(input_len)]
            for _ in range(num_prompts)]


# `--workload`: random-token prompts, or copy a ~300-token passage (where prompt lookup shines).
WORKLOADS = ("synthetic", "repeat")

REPEAT_INSTRUCTION = "Repeat the following text exactly, word for word.\n\n"


def repeat_prompts(tokenizer: Any, num_prompts: int, passage_len: int = 300) -> list[list[int]]:
    """Chat prompts asking to copy a `passage_len`-token passage (the start of one of pkv's
    own source files each, code and docstrings): output that prompt lookup can guess."""
    root = Path(__file__).resolve().parents[2] / "core"  # cli/bench/ -> the package root
    passages = []
    for path in sorted(root.rglob("*.py")):
        ids = tokenizer.encode(path.read_text(), add_special_tokens=False)[:passage_len]
        if len(ids) == passage_len:
            passages.append(tokenizer.decode(ids, skip_special_tokens=True))
    prompts = []
    for i in range(num_prompts):
        messages = [{"role": "user", "content": REPEAT_INSTRUCTION + passages[i % len(passages)]}]
        text = tokenizer.apply_chat_template(messages, True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def workload_prompts(engine: Any, workload: str, num_prompts: int, o: dict[str, Any]
                     ) -> list[list[int]]:
    """The prompts of one `--workload`: random tokens (or `--dataset`), or copy-a-passage."""
    tok = engine.tokenizer
    if workload == "repeat":
        return repeat_prompts(tok, num_prompts)
    vocab_ids = [i for i in range(tok.vocab_size) if i not in tok.special_token_ids]
    return make_prompts(vocab_ids, num_prompts, o["input_len"], o["seed"], o["dataset"],
                        tok.encode, o["shared_prefix_len"])


def run_pkv(engine: Any, prompts: list[list[int]], output_len: int, batch: int,
            long_prompt: list[int] | None = None, profile: bool = False,
            lora_requests: list[Any] | None = None,
            sampling: dict[str, float] | None = None) -> BenchResult:
    """Run the prompts; with `long_prompt`, it arrives once the batch is decoding. With
    `profile`, time every phase of every step (engine.timer). `lora_requests`: an adapter
    (or None) per prompt. `sampling`: SamplingParams' temperature / top_p / top_k (default
    greedy)."""
    from pkv.core.sample.sampling_params import SamplingParams

    params = SamplingParams(**{"temperature": 0, **(sampling or {})}, max_tokens=output_len,
                            ignore_eos=True)
    # One engine serves every batch size of a sweep; the long prompt joins the full batch.
    engine.scheduler.max_num_seqs = batch + (long_prompt is not None)
    engine.kv_cache.pool.reset_prefix_cache()  # runs of a sweep share prompts: no reuse
    result = BenchResult("pkv", batch, len(prompts), 0.0, sum(map(len, prompts)), 0)
    block_bytes = engine.kv_bytes_per_block
    token_bytes = block_bytes // engine.config.block_size
    process = psutil.Process()
    prefill_before = engine.scheduler.num_prefill_tokens
    first_token: dict[str, float] = {}
    last_token: dict[str, float] = {}
    finals: dict[str, list[int]] = {}
    spec = engine.spec_stats
    spec_before = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
    total = (len(prompts) + (long_prompt is not None)) * output_len
    engine.timer.reset()
    engine.timer.enabled = profile
    with make_progress() as progress:
        task = progress.add_task(f"pkv batch {batch}", total=total, info="")
        start = time.perf_counter()
        loras = lora_requests or [None] * len(prompts)
        ids = [engine.add_request(None, prompt, params, lora_request=lora)
               for prompt, lora in zip(prompts, loras)]
        while engine.has_unfinished_requests():
            if long_prompt is not None and result.num_steps == 4:
                engine.add_request("long-prompt", long_prompt, params)
                result.num_requests += 1
            step_start = time.perf_counter()
            prefilled = engine.scheduler.num_prefill_tokens
            outputs = engine.step()
            now = time.perf_counter()
            # A speculating request gains several tokens in one step.
            new_tokens = sum(len(o.outputs[0].token_ids) - len(finals.get(o.request_id, ()))
                             for o in outputs)
            if engine.scheduler.num_prefill_tokens == prefilled:
                result.decode_tokens += new_tokens
                result.decode_s += now - step_start
            else:
                result.prefill_s += now - step_start
            result.output_tokens += new_tokens
            for output in outputs:
                rid = output.request_id
                finals[rid] = output.outputs[0].token_ids
                if rid in last_token:
                    result.max_itl_s = max(result.max_itl_s, now - last_token[rid])
                first_token.setdefault(rid, now)
                last_token[rid] = now
            result.num_steps += 1
            used = engine.kv_cache.pool.num_used_blocks
            if used > result.peak_blocks:
                held = filled_slots(engine)
                result.peak_blocks = used
                result.kv_allocated_bytes = used * block_bytes
                result.kv_filled_bytes = held * token_bytes
            progress.update(task, completed=result.output_tokens)
            if result.num_steps % 16 == 0:
                result.peak_rss_bytes = max(result.peak_rss_bytes, process.memory_info().rss)
        result.elapsed_s = time.perf_counter() - start
    engine.timer.enabled = False
    if profile:
        steps = max(engine.timer.num_steps, 1)
        result.profile_ms = {k: 1000 * v / steps for k, v in engine.timer.totals.items()}
    result.peak_rss_bytes = max(result.peak_rss_bytes, process.memory_info().rss)
    result.prefill_tokens = engine.scheduler.num_prefill_tokens - prefill_before
    result.token_ids = [finals.get(i, []) for i in ids]
    verifies = spec.num_drafts - spec_before[0]
    if verifies:
        drafted = spec.num_draft_tokens - spec_before[1]
        accepted = spec.num_accepted_tokens - spec_before[2]
        result.spec_acceptance_rate = accepted / drafted
        result.spec_mean_accepted_len = 1 + accepted / verifies
    result.mean_ttft_s = sum(first_token.values()) / max(len(first_token), 1) - start
    return result


def load_hf_model(model_path: Path, dtype: Any) -> Any:
    from transformers import AutoModelForCausalLM

    if model_path.is_dir():
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                dtype=dtype).eval()


def run_hf(model: Any, prompts: list[list[int]], output_len: int, batch: int) -> BenchResult:
    """transformers `generate`, static batches, left padding, greedy, exactly output_len."""
    import torch

    result = BenchResult(f"hf (batch {batch})", batch, len(prompts), 0.0,
                         sum(map(len, prompts)), 0)
    process = psutil.Process()
    with make_progress() as progress:
        task = progress.add_task(f"transformers batch {batch}", total=len(prompts) * output_len,
                                 info="")
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


def run_openai(url: str, model: str, headers: dict[str, str], prompts: list[list[int]],
               output_len: int, batch: int) -> BenchResult:
    """The same prompts as completions (token ids) against a server, `batch` at a time."""
    import httpx

    result = BenchResult(f"openai {url}", batch, len(prompts), 0.0, sum(map(len, prompts)), 0)

    async def main() -> None:
        semaphore = asyncio.Semaphore(batch)
        limits = httpx.Limits(max_connections=batch)
        with make_progress() as progress:
            task = progress.add_task(f"{url} batch {batch}", total=len(prompts), info="")
            async with httpx.AsyncClient(headers=headers, timeout=3600, limits=limits) as client:
                async def one(prompt: list[int]) -> None:
                    body = {"model": model, "prompt": prompt, "max_tokens": output_len,
                            "temperature": 0, "ignore_eos": True}
                    async with semaphore:
                        r = await client.post(f"{url}/v1/completions", json=body)
                    if r.status_code != 200:
                        raise ValueError(f"{url} answered {r.status_code}: {r.text[:200]}")
                    result.output_tokens += r.json()["usage"]["completion_tokens"]
                    progress.advance(task)

                await asyncio.gather(*(one(p) for p in prompts))

    start = time.perf_counter()
    asyncio.run(main())
    result.elapsed_s = time.perf_counter() - start
    return result


def peak_rss(pid: int) -> int:
    """Peak resident memory of a process in bytes (Linux VmHWM; current RSS elsewhere)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(l for l in status.splitlines() if l.startswith("VmHWM")).split()[1]) * 1024
    except (OSError, StopIteration):
        return psutil.Process(pid).memory_info().rss
