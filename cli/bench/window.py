"""`pkv bench window`: KV blocks a long generation holds over time, with a sliding window on
every layer (Mistral-style, at SmolLM2-135M's shapes, random weights) and without one; and
for a hybrid model (Gemma 3: every sixth layer global), what its layers hold against the least
they could.

With every layer windowed, blocks behind the window go back to the pool as the request runs
(core/sched/kv_cache_manager.py), so the count levels off at about window / block_size; without a
window it grows with the sequence. A hybrid model's layer groups (core/layers/kv_groups.py) let
its windowed layers do the same while its global layers keep every block.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any


def blocks_over_time(model_dir: Path, prompt_len: int, output_len: int,
                     every: int) -> dict[int, int]:
    """Generate one request; {tokens so far: blocks in use} every `every` tokens."""
    engine = _engine(model_dir, prompt_len + output_len + 1)
    held = _generate(engine, prompt_len, output_len, every)
    engine.shutdown()
    return held


def _engine(model_dir: Path, max_model_len: int) -> Any:
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="1GiB",
                                  max_model_len=max_model_len), show_progress=False)


def _generate(engine: Any, prompt_len: int, output_len: int, every: int,
              per_block: int = 1) -> dict[int, int]:
    """{tokens so far: blocks in use x per_block} every `every` tokens of one request."""
    from pkv.core.sample.sampling_params import SamplingParams

    prompt = [100 + (7 * i) % 40000 for i in range(prompt_len)]
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=output_len,
                                                      ignore_eos=True))
    held, generated = {}, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        generated += len(outputs)
        if any(o.finished for o in outputs):
            break  # its blocks are back in the pool
        if generated % every == 0 and prompt_len + generated not in held:
            held[prompt_len + generated] = engine.get_stats().num_blocks_used * per_block
    return held


def window_vs_full(window: int, prompt_len: int, output_len: int, every: int,
                   shape: dict[str, Any] | None = None) -> dict[str, dict[int, int]]:
    """Blocks over time for a windowed and an unwindowed model of the same shape."""
    from pkv.cli.bench.families import write_random_model

    with tempfile.TemporaryDirectory(prefix="pkv-bench-window-") as tmp:
        windowed = write_random_model("mistral", Path(tmp) / "window",
                                      {**(shape or {}), "sliding_window": window})
        full = write_random_model("mistral", Path(tmp) / "full",
                                  {**(shape or {}), "sliding_window": None})
        return {f"window {window}": blocks_over_time(windowed, prompt_len, output_len, every),
                "no window": blocks_over_time(full, prompt_len, output_len, every)}


def hybrid_vs_least(family: str, prompt_len: int, output_len: int, every: int,
                    shape: dict[str, Any] | None = None) -> dict[str, dict[int, int]]:
    """Layer-blocks (one layer's K/V for one block of tokens) a hybrid model holds over one
    generation, beside the least its layers need (every block for a global layer, the blocks
    its window spans for a windowed one) and what one table for all layers holds."""
    from pkv.cli.bench.families import write_random_model

    with tempfile.TemporaryDirectory(prefix="pkv-bench-window-") as tmp:
        longest = {"max_position_embeddings": max(2048, prompt_len + output_len + 1)}
        model_dir = write_random_model(family, Path(tmp) / family, {**longest, **(shape or {})})
        engine = _engine(model_dir, prompt_len + output_len + 1)
        groups = engine.runner.kv_groups
        # A pool block holds `slots` layers' K/V: count layer-blocks.
        held = _generate(engine, prompt_len, output_len, every, per_block=groups.slots)
        engine.shutdown()
    windows = [g.window for g in groups.groups for _ in g.layers]
    least = {t: sum(_least_blocks(t - 1, w) for w in windows) for t in held}
    one_table = {t: len(windows) * _least_blocks(t - 1, None) for t in held}
    return {"pkv": held, "least": least, "one table": one_table}


def _least_blocks(computed: int, window: int | None, block_size: int = 16) -> int:
    """Blocks one layer must hold once `computed` tokens have K/V and the next one attends."""
    if window is None or computed + 1 <= window:
        return -(-computed // block_size)
    first_needed = computed + 1 - window  # the oldest key the next token reads
    return -(-computed // block_size) - first_needed // block_size


def window_table(runs: dict[str, dict[int, int]], block_size: int,
                 unit: str = "KV blocks") -> Any:
    from rich.table import Table

    table = Table(title=f"{unit} ({block_size} tokens each) held by one request")
    table.add_column("tokens", justify="right")
    for name in runs:
        table.add_column(name, justify="right")
    for tokens in sorted(next(iter(runs.values()))):
        table.add_row(str(tokens), *(str(r.get(tokens, "")) for r in runs.values()))
    return table
