"""`pkv bench window`: KV blocks a long generation holds over time, with a sliding window on
every layer (Mistral-style, at SmolLM2-135M's shapes, random weights) and without one.

With every layer windowed, blocks behind the window go back to the pool as the request runs
(core/sched/kv_cache_manager.py), so the count levels off at about window / block_size; without a
window it grows with the sequence.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any


def blocks_over_time(model_dir: Path, prompt_len: int, output_len: int,
                     every: int) -> dict[int, int]:
    """Generate one request; {tokens so far: blocks in use} every `every` tokens."""
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm_engine import LLMEngine
    from pkv.core.sample.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="1GiB",
                                    max_model_len=prompt_len + output_len + 1),
                       show_progress=False)
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
            held[prompt_len + generated] = engine.get_stats().num_blocks_used
    engine.shutdown()
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


def window_table(runs: dict[str, dict[int, int]], block_size: int) -> Any:
    from rich.table import Table

    table = Table(title=f"KV blocks ({block_size} tokens each) held by one request")
    table.add_column("tokens", justify="right")
    for name in runs:
        table.add_column(name, justify="right")
    for tokens in sorted(next(iter(runs.values()))):
        table.add_row(str(tokens), *(str(r.get(tokens, "")) for r in runs.values()))
    return table
