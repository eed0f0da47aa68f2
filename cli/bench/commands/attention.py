"""`pkv bench attention`: decode-attention time per engine step of every attention backend
usable here, on one random paged layout (no model: the sizes are options)."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from pkv.cli.bench.console import console
from pkv.cli.errors import user_errors


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
    kv_cache_dtype: Annotated[str, typer.Option(help="KV storage, a list compares: float32,int8,fp8_e4m3.")] = "float32",
) -> None:
    """Decode-attention time per engine step for every attention backend usable here (and
    every KV cache dtype asked for, each against float32)."""
    import torch
    from rich.table import Table

    from pkv.cli.bench.cpu_info import print_cpu_line
    from pkv.core.layers.kv_format import kv_format, quantize_rows
    from pkv.core.registry import discover
    from pkv.plugins.attention.layouts import random_paged_layout

    print_cpu_line(console)
    with user_errors():
        if min(batch, context, heads, kv_heads, head_dim, layers, repeat, block_size) < 1:
            raise ValueError("every size must be >= 1")
        if heads % kv_heads:
            raise ValueError(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError("--sliding-window must be >= 1")
        formats = [kv_format(name.strip(), torch.float32, head_dim)
                   for name in kv_cache_dtype.split(",")]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        registry = discover()
        q, k, v, k_cache, v_cache, meta = random_paged_layout(
            [(context, 1)] * batch, block_size, heads, kv_heads, head_dim, seed=0, device=device)
        times: dict[tuple[str, str], float] = {}
        for fmt in formats:
            kc, vc = ((quantize_rows(k_cache, fmt.dtype), quantize_rows(v_cache, fmt.dtype))
                      if fmt.scaled else (k_cache.to(fmt.dtype), v_cache.to(fmt.dtype)))
            for name, t in _time_backends(registry, device, q, k, v, kc, vc, meta, head_dim,
                                          layers, repeat, sliding_window, soft_cap).items():
                times[name, fmt.name] = t
        table = Table(title=f"decode attention per step: batch {batch}, context {context}, "
                            f"{heads}/{kv_heads} heads x {head_dim}, {layers} layers, window "
                            f"{sliding_window}, soft-cap {soft_cap}")
        for column in ("backend", "KV dtype", "ms per step", "vs torch", "vs float32 KV"):
            table.add_column(column, justify="left" if column in ("backend", "KV dtype")
                             else "right")
        for (name, kv), t in sorted(times.items(), key=lambda kv: kv[1]):
            torch_t, f32_t = times.get(("torch", kv), t), times.get((name, "float32"), t)
            table.add_row(name, kv, f"{1000 * t:.1f}", f"{torch_t / t:.2f}x faster",
                          f"{f32_t / t:.2f}x faster")
        console.print(table)


def _time_backends(registry: Any, device: str, q: Any, k: Any, v: Any, k_cache: Any,
                   v_cache: Any, meta: Any, head_dim: int, layers: int, repeat: int,
                   sliding_window: int | None, soft_cap: float | None) -> dict[str, float]:
    """Best time of a step's decode attention over `layers` layers, per usable backend."""
    import time

    from pkv.core.registry import select_attention_backend
    from pkv.core.worker.huge_pages import empty_on_huge_pages

    # One cache per layer, as in a model: at large batches a step's K/V then streams from
    # memory, as it does in the engine, instead of sitting in the CPU's cache. Past 4 GiB
    # of copies the layers take the distinct caches in turn (still far beyond any cache).
    per_layer = 2 * k_cache.numel() * k_cache.element_size()
    distinct = max(1, min(layers, (4 << 30) // per_layer))
    # Each copy in memory as the engine's KV pool is (core/worker/huge_pages.py).
    copies = [tuple(empty_on_huge_pages(tuple(c.shape), c.dtype, c.device).copy_(c)
                    for c in (k_cache, v_cache)) for _ in range(distinct)]
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
            if q.is_cuda:  # (kernels run after their launch returns)
                torch.cuda.synchronize(q.device)
            best = min(best, time.perf_counter() - start)
        times[name] = best
    return times
