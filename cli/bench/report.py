"""Tables, JSON and plots for `pkv bench` results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pkv.cli.bench.workload import BenchResult


def _mib(b: int) -> str:
    return f"{b / 2**20:,.0f} MiB" if b else "-"


def offline_table(results: list[BenchResult]) -> Table:
    table = Table(title="pkv bench: offline throughput")
    for column in ("engine", "batch", "req/s", "out tok/s", "decode tok/s", "all tok/s", "step ms",
                   "TTFT ms", "max ITL ms", "prefill tok", "KV blocks", "KV alloc",
                   "KV filled", "KV waste", "peak RSS"):
        table.add_column(column, justify="left" if column == "engine" else "right")
    for r in results:
        j = r.as_json()
        table.add_row(r.name, str(r.batch), f"{j['request_throughput']:.2f}",
                      f"{j['output_throughput']:.1f}",
                      f"{r.decode_tps:.1f}" if r.decode_s else "-", f"{j['total_throughput']:.1f}",
                      f"{j['mean_step_ms']:.1f}" if r.num_steps else "-",
                      f"{j['mean_ttft_ms']:.0f}" if r.mean_ttft_s else "-",
                      f"{j['max_itl_ms']:.0f}" if r.max_itl_s else "-",
                      str(r.prefill_tokens or "-"), str(r.peak_blocks or "-"),
                      _mib(r.kv_allocated_bytes), _mib(r.kv_filled_bytes),
                      f"{r.fragmentation_pct:.1f}%" if r.kv_allocated_bytes else "-",
                      _mib(r.peak_rss_bytes))
    return table


def rounds_table(batch: int, pairs: list[tuple[BenchResult, BenchResult | None]]) -> Table:
    """pkv and its baseline round by round (`--rounds`): decode and output tok/s and their
    ratios, with the medians."""
    name = pairs[0][1].name if pairs[0][1] is not None else "-"
    table = Table(title=f"pkv bench --rounds: batch {batch}, pkv against {name}, run alternately")
    for column in ("round", "pkv decode tok/s", f"{name} decode tok/s", "decode ratio",
                   "pkv out tok/s", f"{name} out tok/s", "out ratio"):
        table.add_column(column, justify="right")
    decode, out = [], []
    for i, (mine, other) in enumerate(pairs, 1):
        if other is None:
            table.add_row(str(i), f"{mine.decode_tps:.1f}", "-", "-", f"{mine.output_tps:.1f}",
                          "-", "-")
            continue
        out.append(mine.output_tps / other.output_tps)
        timed = bool(mine.decode_s and other.decode_s)  # (a baseline may not time decode)
        if timed:
            decode.append(mine.decode_tps / other.decode_tps)
        table.add_row(str(i), f"{mine.decode_tps:.1f}",
                      f"{other.decode_tps:.1f}" if other.decode_s else "-",
                      f"{decode[-1]:.2f}x" if timed else "-", f"{mine.output_tps:.1f}",
                      f"{other.output_tps:.1f}", f"{out[-1]:.2f}x")
    if out:  # (the median round's, as the ratio quoted: the lower middle of an even count)
        table.add_row("median", "", "",
                      f"[bold]{lower_median(decode):.2f}x[/]" if decode else "-", "", "",
                      f"[bold]{lower_median(out):.2f}x[/]")
    return table


def lower_median(values: list[float]) -> float:
    """The median of an odd count; of an even one, the lower of the two middle values (a
    round that was run, not an average of two)."""
    return sorted(values)[(len(values) - 1) // 2]


def profile_table(results: list[BenchResult]) -> Table:
    """Where a step's time goes: mean ms per step by phase; overhead is all but the forward."""
    from pkv.core.worker.step_timer import PHASES

    table = Table(title="pkv bench --profile: mean ms per engine step")
    for column in ("batch", *PHASES, "step", "overhead", "overhead %"):
        table.add_column(column, justify="right")
    for r in results:
        if r.profile_ms is None:
            continue
        step = sum(r.profile_ms.values())
        overhead = step - r.profile_ms["forward"]
        table.add_row(str(r.batch), *(f"{r.profile_ms[p]:.2f}" for p in PHASES), f"{step:.2f}",
                      f"{overhead:.2f}", f"{100 * overhead / step:.1f}%")
    return table


def roofline_table(results: list[BenchResult]) -> Table:
    """Decode against the GEMM roofline, and the roofline's GEMMs against the CPU's peak."""
    table = Table(title="pkv bench --roofline: decode tokens/s vs the float32 GEMM roofline, "
                        "and its GEMMs vs this CPU's float32 multiply-add peak")
    for column in ("batch", "pkv decode tok/s", "roofline tok/s", "% of roofline",
                   "GEMM GFLOP/s", "FMA peak GFLOP/s", "GEMM % of peak"):
        table.add_column(column, justify="right")
    for r in results:
        if r.roofline_tps:
            peak = r.gemm_peak_pct
            table.add_row(str(r.batch), f"{r.decode_tps:.1f}", f"{r.roofline_tps:.1f}",
                          f"{r.roofline_pct:.0f}%", f"{r.roofline_gflops or 0:.1f}",
                          f"{r.fma_peak_gflops:.1f}" if r.fma_peak_gflops else "-",
                          f"{peak:.0f}%" if peak is not None else "-")
    return table


def prefill_roofline_table(results: list[BenchResult]) -> Table:
    table = Table(title="pkv bench --roofline: prefill tokens/s vs the float32 GEMM roofline "
                        "of the prompts' FLOPs (linears and attention)")
    for column in ("batch", "prompt tokens", "pkv prefill tok/s", "roofline tok/s",
                   "% of roofline"):
        table.add_column(column, justify="right")
    for r in results:
        if r.prefill_roofline_tps and r.prefill_s:
            table.add_row(str(r.batch), str(r.prefill_tokens), f"{r.prefill_tps:.1f}",
                          f"{r.prefill_roofline_tps:.1f}", f"{r.prefill_roofline_pct:.0f}%")
    return table


def serve_table(summaries: list[dict[str, Any]], url: str) -> Table:
    table = Table(title=f"pkv bench serve: {url}")
    columns = ["concurrency", "done", "req/s", "out tok/s", "goodput"]
    for name in ("ttft", "tpot", "itl"):
        columns += [f"{name} p{p}" for p in (50, 90, 99)]
    for column in columns:
        table.add_column(column, justify="right")
    for s in summaries:
        row = [str(s["concurrency"]), f"{s['completed']}/{s['completed'] + s['failed']}",
               f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
               f"{s['goodput']:.2f}"]
        for name in ("ttft", "tpot", "itl"):
            row += [f"{s[f'p{p}_{name}_ms']:.0f} ms" for p in (50, 90, 99)]
        table.add_row(*row)
    return table


def offline_json(runs: list[tuple[BenchResult, BenchResult | None]]) -> dict[str, Any]:
    """One entry per batch size; the largest batch's figures also at the top level."""
    entries = []
    for pkv, baseline in runs:
        entry = pkv.as_json()
        if baseline is not None:
            entry["baseline"] = {**baseline.as_json(),
                                 "ratio": pkv.output_tps / baseline.output_tps}
        entries.append(entry)
    return {**entries[-1], "runs": entries}


def write_json(path: Path, data: dict[str, Any], console: Console) -> None:
    path.write_text(json.dumps(data, indent=2))
    console.print(f"wrote {path}")


def plot_sweep(path: Path, xs: list[int], series: dict[str, list[float]], latency_name: str,
               latency: dict[str, list[float]], xlabel: str, console: Console) -> None:
    """Throughput (left) and latency (right) across a sweep, one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, ys in series.items():
        ax1.plot(xs, ys, marker="o", label=name)
    ax1.set(xlabel=xlabel, ylabel="output tokens/s", title="throughput", xscale="log")
    for name, ys in latency.items():
        ax2.plot(xs, ys, marker="o", label=name)
    ax2.set(xlabel=xlabel, ylabel=latency_name, title="latency", xscale="log")
    for ax in (ax1, ax2):
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    console.print(f"wrote {path}")
