"""`pkv bench offload`: the prefix cache's disk tier against none, on documents that do not
fit in the KV pool.

Each document (random token ids) is read once (the warm-up), then the measured requests ask
about them in shuffled rounds, one request at a time so that each time to first token is its
own prefill. The pool holds about `pool_docs` documents, so without the tier a document is
mostly gone from RAM when it comes back; with it, the evicted blocks come back from disk. A
new engine on the same folder then asks about a known document (does a restart hit?).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRun:
    """One request: its time to first token and where its prompt's KV came from."""

    doc: int
    warm_up: bool
    ttft: float
    prefill_tokens: int  # computed
    ram_hit_tokens: int
    disk_hit_tokens: int


@dataclass(slots=True)
class OffloadRun:
    """One engine's pass over the workload."""

    name: str
    requests: list[RequestRun] = field(default_factory=list)

    def measured(self) -> list[RequestRun]:
        return [r for r in self.requests if not r.warm_up]

    def prefill_tokens(self) -> int:
        return sum(r.prefill_tokens for r in self.measured())


def _prompts(num_docs: int, doc_tokens: int, question_tokens: int, num_requests: int,
             vocab: int, seed: int) -> tuple[list[tuple[int, list[int]]], list[list[int]]]:
    """(document, prompt) of each measured request, and the documents."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1000, vocab) for _ in range(doc_tokens)] for _ in range(num_docs)]
    order: list[int] = []
    while len(order) < num_requests:
        order += rng.sample(range(num_docs), num_docs)
    out = []
    for d in order[:num_requests]:
        question = [rng.randrange(1000, vocab) for _ in range(question_tokens)]
        out.append((d, docs[d] + question))
    return out, docs


def _one(engine: Any, prompt: list[int], max_tokens: int, request_id: str) -> tuple[float, int]:
    """Run one request alone; its time to first token and prefill tokens computed."""
    from pkv.core.sample.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.scheduler.num_prefill_tokens
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    ttft = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if ttft is None and any(o.outputs[0].token_ids for o in outputs):
            ttft = time.perf_counter() - start
    return ttft or 0.0, engine.scheduler.num_prefill_tokens - before


def _request(engine: Any, name: str, doc: int, warm: bool, prompt: list[int],
             max_tokens: int) -> RequestRun:
    offload = engine.kv_offload
    ram0 = engine.kv_cache.prefix_hits
    disk0 = offload.saved_tokens if offload is not None else 0
    ttft, prefill = _one(engine, prompt, max_tokens, name)
    disk = (offload.saved_tokens if offload is not None else 0) - disk0
    return RequestRun(doc, warm, ttft, prefill, engine.kv_cache.prefix_hits - ram0, disk)


def _pass(engine: Any, name: str, docs: list[list[int]], requests: list[tuple[int, list[int]]],
          question: list[int], max_tokens: int) -> OffloadRun:
    run = OffloadRun(name)
    for d, doc in enumerate(docs):
        run.requests.append(_request(engine, f"{name}-warm{d}", d, True, doc + question,
                                     max_tokens))
    for i, (d, prompt) in enumerate(requests):
        run.requests.append(_request(engine, f"{name}-{i}", d, False, prompt, max_tokens))
    return run


def run_offload_bench(model: str | None, num_docs: int, doc_tokens: int, num_requests: int,
                      pool_docs: float, question_tokens: int, max_tokens: int, seed: int,
                      offload_dir: str | None, tensor_parallel_size: int = 1,
                      pipeline_parallel_size: int = 1) -> dict[str, Any]:
    """Both passes and the restart; every figure as a dict (see `offload_table`)."""
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm_engine import LLMEngine
    from pkv.core.layers.kv_groups import plan_kv_groups
    from pkv.core.model_loader.loader import open_model
    from pkv.core.sched.kv_cache_manager import cdiv
    from pkv.core.worker.model_setup import pipeline_stage

    cfg = open_model(model).config
    block_size = 16
    prompt_len = doc_tokens + question_tokens
    split = {"tensor_parallel_size": tensor_parallel_size,
             "pipeline_parallel_size": pipeline_parallel_size}
    # The pool holds what its fullest rank holds: the most KV heads, the most layers of a
    # KV group (a block id holds that many layers' K/V; a hybrid model's document takes its
    # blocks in every group).
    heads = cdiv(cfg.num_key_value_heads, tensor_parallel_size)
    groups = plan_kv_groups(cfg.layer_windows)
    slots = max(groups.for_layers(pipeline_stage(EngineConfig(model=model, **split), cfg, s)
                                  .layers(cfg.num_hidden_layers)).slots
                for s in range(pipeline_parallel_size))
    per_block = 2 * slots * block_size * heads * cfg.head_dim * 4
    pool_blocks = int(pool_docs * cdiv(prompt_len + max_tokens, block_size)
                      * len(groups.groups))
    options: dict[str, Any] = {
        "model": model, "block_size": block_size, "kv_cache_memory": pool_blocks * per_block,
        "max_model_len": prompt_len + max_tokens + block_size, "max_num_seqs": 1, "seed": seed,
        **split}
    requests, docs = _prompts(num_docs, doc_tokens, question_tokens, num_requests,
                              cfg.vocab_size, seed)
    question = [1000 + (7 * i) % 500 for i in range(question_tokens)]
    with tempfile.TemporaryDirectory(prefix="pkv-bench-offload-") as tmp:
        folder = offload_dir or tmp
        plain = LLMEngine(EngineConfig(**options), show_progress=False)
        if plain.runner.kv_format.name != "float32":
            raise ValueError("pkv bench offload sizes the pool for float32 KV (CPU)")
        num_blocks = plain.runner.num_blocks
        base = _pass(plain, "none", docs, requests, question, max_tokens)
        plain.shutdown()
        del plain
        # Room for every document several times over: this measures hits, not LRU.
        size = 4 * num_docs * pool_blocks * per_block
        tiered = LLMEngine(EngineConfig(**options, kv_offload_dir=folder, kv_offload_size=size),
                           show_progress=False)
        tier = _pass(tiered, "disk", docs, requests, question, max_tokens)
        tier_stats = asdict(tiered.get_stats().kv_offload)
        tiered.shutdown()  # saves the blocks still in RAM
        del tiered
        restarted = LLMEngine(EngineConfig(**options, kv_offload_dir=folder, kv_offload_size=size),
                              show_progress=False)
        after = _request(restarted, "restart", requests[0][0], False,
                         docs[requests[0][0]] + question[::-1], max_tokens)
        restarted.shutdown()
    return {"num_blocks": num_blocks, "block_bytes": per_block, "prompt_len": prompt_len,
            "none": [asdict(r) for r in base.requests], "disk": [asdict(r) for r in tier.requests],
            "disk_stats": tier_stats, "restart": asdict(after),
            "summary": summarize(base, tier, after, block_size)}


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(base: OffloadRun, tier: OffloadRun, after: RequestRun,
              block_size: int) -> dict[str, Any]:
    """The headline figures: prefill tokens and TTFT p50s (disk hits vs cold prefills)."""
    disk_hits = [r.ttft for r in tier.measured() if r.disk_hit_tokens > 0]
    cold = [r.ttft for run in (base, tier) for r in run.requests
            if r.ram_hit_tokens == 0 and r.disk_hit_tokens == 0]
    return {
        "prefill_tokens_none": base.prefill_tokens(),
        "prefill_tokens_disk": tier.prefill_tokens(),
        "prefill_ratio": tier.prefill_tokens() / max(1, base.prefill_tokens()),
        "prefill_ratio_with_warm_up": (sum(r.prefill_tokens for r in tier.requests)
                                       / max(1, sum(r.prefill_tokens for r in base.requests))),
        "num_disk_hit_requests": len(disk_hits), "num_cold_requests": len(cold),
        "ttft_p50_disk_hit": _p50(disk_hits), "ttft_p50_cold": _p50(cold),
        "ttft_ratio": _p50(disk_hits) / _p50(cold) if disk_hits and cold else float("nan"),
        "restart_disk_hit_tokens": after.disk_hit_tokens,
        "restart_prefill_tokens": after.prefill_tokens, "restart_ttft": after.ttft,
        "restart_hit": after.disk_hit_tokens >= block_size,
    }


def offload_table(result: dict[str, Any]) -> Any:
    from rich.table import Table

    s = result["summary"]
    table = Table(title=f"prefix cache disk tier: {result['num_blocks']} pool blocks "
                        f"({result['block_bytes'] // 1024} KiB each), prompts of "
                        f"{result['prompt_len']} tokens")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("prefill tokens computed, no tier (measured)", str(s["prefill_tokens_none"]))
    table.add_row("prefill tokens computed, disk tier (measured)", str(s["prefill_tokens_disk"]))
    table.add_row("ratio (target <= 0.2)", f"{s['prefill_ratio']:.3f}")
    table.add_row("ratio, warm-up included", f"{s['prefill_ratio_with_warm_up']:.3f}")
    table.add_row(f"TTFT p50, disk hits ({s['num_disk_hit_requests']})",
                  f"{1000 * s['ttft_p50_disk_hit']:.0f} ms")
    table.add_row(f"TTFT p50, cold prefills ({s['num_cold_requests']})",
                  f"{1000 * s['ttft_p50_cold']:.0f} ms")
    table.add_row("ratio (target <= 0.5)", f"{s['ttft_ratio']:.3f}")
    d = result["disk_stats"]
    table.add_row("disk writes / drops / MiB", f"{d['writes']} / {d['drops']} / "
                                               f"{d['bytes_used'] / 2**20:.0f}")
    table.add_row("after a restart: first request hits",
                  f"{'yes' if s['restart_hit'] else 'no'} ({s['restart_disk_hit_tokens']} "
                  f"tokens from disk, {s['restart_prefill_tokens']} computed, TTFT "
                  f"{1000 * s['restart_ttft']:.0f} ms)")
    return table
