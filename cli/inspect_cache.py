"""`pkv inspect-cache`: the KV cache of a running server, or of a simulated workload."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from pkv.cli.errors import output_file, user_errors
from pkv.cli.http import auth_headers, base_url, get_json
from pkv.core.sched.cache_inspector import CACHED, FREE, SHARED, USED, CacheSnapshot

console = Console()
_STYLE = {FREE: ("grey35", "free"), CACHED: ("cyan", "cached, free"),
          USED: ("green", "in use"), SHARED: ("magenta", "shared")}
_MAP_LIMIT = 4096


def inspect_cache(
    url: Annotated[Optional[str], typer.Option(help="A running `pkv serve` (base URL).")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="PKV_API_KEY", help="Its API key.")] = None,
    simulate: Annotated[bool, typer.Option(help="Run a simulated workload offline instead.")] = False,
    model: Annotated[Optional[str], typer.Option(help="Model for --simulate (default: bundled).")] = None,
    requests: Annotated[int, typer.Option(help="Simulated requests.")] = 16,
    shared_prefix_len: Annotated[int, typer.Option(help="Tokens every prompt shares.")] = 64,
    unique_len: Annotated[int, typer.Option(help="Tokens of each prompt's own suffix.")] = 16,
    output_len: Annotated[int, typer.Option(help="New tokens per simulated request.")] = 16,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block (simulation).")] = 16,
    kv_cache_memory: Annotated[str, typer.Option(help="KV pool size (simulation).")] = "64MiB",
    kv_cache_dtype: Annotated[str, typer.Option(help="KV cache storage (simulation): auto, int8, fp8_e4m3, ...")] = "auto",
    max_model_len: Annotated[int, typer.Option(help="Longest sequence (simulation).")] = 1024,
    png: Annotated[Optional[Path], typer.Option(dir_okay=False, callback=output_file, help="Write a picture of the block map.")] = None,
) -> None:
    """Show pool usage, hit rate, evictions, block tables, fragmentation and a block map."""
    with user_errors():
        if simulate == (url is not None):
            raise ValueError("give either --url URL or --simulate")
        simulation = {"model": (model, None), "requests": (requests, 16),
                      "shared-prefix-len": (shared_prefix_len, 64),
                      "unique-len": (unique_len, 16), "output-len": (output_len, 16),
                      "block-size": (block_size, 16), "kv-cache-memory": (kv_cache_memory, "64MiB"),
                      "kv-cache-dtype": (kv_cache_dtype, "auto"),
                      "max-model-len": (max_model_len, 1024)}
        changed = [f"--{name}" for name, (value, default) in simulation.items()
                   if value != default]
        if url is not None and changed:  # (a server's cache is what it is)
            raise ValueError(f"{', '.join(changed)}: for --simulate only, not with --url")
        if simulate:
            snapshot = _simulate(model, requests, shared_prefix_len, unique_len, output_len,
                                 block_size, kv_cache_memory, kv_cache_dtype, max_model_len)
        else:
            snapshot = _fetch(url or "", api_key)
        render(snapshot, console)
        if png is not None:
            write_png(snapshot, png)
            console.print(f"wrote {png}")


def _fetch(url: str, api_key: str | None) -> CacheSnapshot:
    answer = get_json(base_url(url), "/admin/cache", auth_headers(api_key))
    try:
        return CacheSnapshot.from_dict(answer)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # another pkv's shape
        raise ValueError(f"{url}/admin/cache answered no cache snapshot this pkv reads "
                         f"({type(exc).__name__}: {exc}); is it a pkv server of this "
                         "version?") from None


def _simulate(model: str | None, num: int, shared: int, unique: int, output_len: int,
              block_size: int, kv_cache_memory: str, kv_cache_dtype: str,
              max_model_len: int) -> CacheSnapshot:
    """Requests sharing a prefix; the snapshot is taken mid-decode, when sharing shows."""
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm_engine import LLMEngine
    from pkv.core.sample.sampling_params import SamplingParams
    from pkv.core.sched.cache_inspector import take_snapshot

    if min(num, output_len) < 1 or min(shared, unique) < 0 or shared + unique < 1:
        raise ValueError("--requests and --output-len must be >= 1, lengths >= 0")
    engine = LLMEngine(EngineConfig(model=model, block_size=block_size,
                                    kv_cache_memory=kv_cache_memory,
                                    kv_cache_dtype=kv_cache_dtype,
                                    max_model_len=max_model_len))
    rng = random.Random(0)
    vocab = range(100, engine.model_config.vocab_size)
    prefix = [rng.choice(vocab) for _ in range(shared)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i in range(num):
        engine.add_request(f"sim-{i}", prefix + [rng.choice(vocab) for _ in range(unique)],
                           params)
    with console.status("simulating"):
        while engine.has_unfinished_requests():
            engine.step()
            running = engine.scheduler.running
            if running and all(r.num_output_tokens >= output_len // 2 for r in running):
                break
        snapshot = take_snapshot(engine)
        engine.generate_until_done()
    return snapshot


def render(s: CacheSnapshot, out: Console) -> None:
    mib = s.bytes_per_block / 2**20
    summary = Table(title="KV cache", show_header=False)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    rows = [("pool", f"{s.num_blocks} blocks x {s.block_size} tokens = "
                     f"{s.num_blocks * mib:,.1f} MiB"),
            ("KV dtype", f"{s.kv_cache_dtype}, {s.bytes_per_block / 2**10:,.1f} KiB per block"),
            ("in use", f"{s.used} ({100 * s.used / s.num_blocks:.1f}%)"),
            ("cached, free", str(s.cached_free)), ("free", str(s.free)),
            ("prefix hit rate", f"{100 * s.hit_rate:.1f}% ({s.prefix_cache_hits} of "
                                f"{s.prefix_cache_queries} tokens)"),
            ("evictions", str(s.evictions)), ("preemptions", str(s.preemptions)),
            ("fragmentation", f"{100 * s.fragmentation:.1f}% ({s.slots_allocated} slots "
                              f"allocated, {s.tokens_stored} tokens stored)")]
    for key, value in rows:
        summary.add_row(key, value)
    out.print(summary)
    if s.requests:
        table = Table(title="block tables of running requests")
        for column in ("request", "tokens", "computed", "blocks", "shared", "block table"):
            table.add_column(column, justify="left" if column in ("request", "block table")
                             else "right")
        for r in s.requests:
            cells = [f"[magenta]{b}[/]" if sh else str(b) for b, sh in zip(r.block_ids, r.shared)]
            shown = " ".join(cells[:16]) + (f" ... (+{len(cells) - 16})" if len(cells) > 16 else "")
            table.add_row(r.request_id, str(r.num_tokens), str(r.num_computed_tokens),
                          str(len(r.block_ids)), str(sum(r.shared)), shown)
        out.print(table)
    out.print(Panel(Group(_block_map_text(s.block_map), _legend()), title="block map",
                    expand=False))


def _block_map_text(block_map: str, width: int = 64) -> Text:
    text = Text()
    for i, state in enumerate(block_map[:_MAP_LIMIT]):
        if i and i % width == 0:
            text.append("\n")
        text.append("■", style=_STYLE[state][0])
    if len(block_map) > _MAP_LIMIT:
        text.append(f"\n... {len(block_map) - _MAP_LIMIT} more blocks", style="dim")
    return text


def _legend() -> Text:
    text = Text("\n")
    for state, (style, label) in _STYLE.items():
        text.append("■ ", style=style)
        text.append(f"{label}  ")
    return text


def write_png(s: CacheSnapshot, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    order = [FREE, CACHED, USED, SHARED]
    colors = ["#d9d9d9", "#4fc3f7", "#66bb6a", "#ab47bc"]
    width = 64
    values = np.array([order.index(c) for c in s.block_map], dtype=float)
    rows = -(-len(values) // width)
    grid = np.full(rows * width, np.nan)
    grid[:len(values)] = values
    fig, ax = plt.subplots(figsize=(10, max(2.0, 0.18 * rows + 1.2)))
    ax.imshow(grid.reshape(rows, width), cmap=ListedColormap(colors), vmin=0, vmax=3,
              aspect="auto", interpolation="nearest")
    ax.set(xticks=[], yticks=[], title=f"KV blocks: {s.used} in use, {s.cached_free} cached, "
                                       f"{s.free} free; hit rate {100 * s.hit_rate:.0f}%")
    ax.legend(handles=[Patch(color=c, label=_STYLE[k][1]) for k, c in zip(order, colors)],
              loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


