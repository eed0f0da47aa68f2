"""`pkv bench soak`: a real `pkv serve` held at capacity for minutes under a hostile mix, and
its verdict (the traffic and the tables: pkv.cli.bench.soak; the memory curve:
pkv.cli.bench.soak_memory)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Optional

import typer

from pkv.cli.bench.console import console
from pkv.cli.bench.soak_memory import MAX_WARMUP_MIB, PLATEAU_BAND_MIB
from pkv.cli.errors import output_file, user_errors


def soak(
    model: Annotated[Optional[str], typer.Argument(help="HF folder or .gguf; default: bundled")] = None,
    duration: Annotated[float, typer.Option(help="Seconds of load.")] = 600,
    interval: Annotated[float, typer.Option(help="Seconds between memory samples (the server idles for each).")] = 60,
    max_num_seqs: Annotated[int, typer.Option(help="The server's running batch.")] = 32,
    concurrency: Annotated[Optional[int], typer.Option(help="Clients (default 2 x max-num-seqs).")] = None,
    warmup: Annotated[float, typer.Option(min=0, help="Seconds of load before the first sample.")] = 0,
    max_model_len: Annotated[int, typer.Option(help="The server's longest sequence.")] = 1024,
    max_slope: Annotated[float, typer.Option(help="MiB per minute memory outside the KV pool may climb after its plateau.")] = 1.0,
    max_peak_mib: Annotated[Optional[float], typer.Option(help="Most MiB memory outside the KV pool may reach (default: no bound).")] = None,
    max_warmup_mib: Annotated[float, typer.Option(help="Most MiB memory outside the KV pool may rise above the idle server's before any load.")] = MAX_WARMUP_MIB,
    plateau_band_mib: Annotated[float, typer.Option(help="The plateau: no later sample more than this many MiB above its first.")] = PLATEAU_BAND_MIB,
    max_ttft_growth: Annotated[float, typer.Option(help="Most the last sample's p99 TTFT may be, as a multiple of the first's.")] = 2.0,
    seed: Annotated[int, typer.Option(help="Seed of the traffic mix.")] = 0,
    trace: Annotated[bool, typer.Option(help="Trace the server's Python heap (tracemalloc; slower) and list where it grew.")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", dir_okay=False, callback=output_file, help="Write every figure here.")] = None,
    plot: Annotated[Optional[Path], typer.Option(dir_okay=False, callback=output_file, help="PNG of memory over time.")] = None,
) -> None:
    """A real server at capacity for `duration` under a hostile mix; fails on unexpected
    errors, held KV blocks, memory that climbs after its plateau, growing open files, or a p99
    TTFT that grows past `max_ttft_growth` times the first sample's."""
    import dataclasses
    import secrets

    from pkv.cli.bench import report
    from pkv.cli.bench.soak import (Minute, caches_table, drive, memory_report, memory_table,
                                    minutes_table, state_table, verdict, wait_idle)
    from pkv.cli.bench.soak_memory import MemoryCurve, plot_curve
    from pkv.cli.serve_process import start_pkv_serve
    from pkv.core.server.memory_report import TRACE_ENV

    with user_errors():
        positive = (duration, interval, max_num_seqs, 1 if concurrency is None else concurrency,
                    max_ttft_growth, plateau_band_mib)
        if min(positive) <= 0 or warmup < 0:
            raise ValueError("--duration, --interval, --max-num-seqs, --concurrency, "
                             "--max-ttft-growth and --plateau-band-mib must be > 0, "
                             "--warmup >= 0")
        key = secrets.token_hex(16)
        headers = {"Authorization": f"Bearer {key}"}
        args = ["--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
                "--kv-cache-memory", "256MiB", *([model] if model else [])]
        clients = concurrency or 2 * max_num_seqs
        curve = MemoryCurve(interval / 60, band_mib=plateau_band_mib)
        totals, minutes, reports = [], [], []
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
        problems = verdict(minutes, start, end, curve, max_slope, max_peak_mib, max_warmup_mib,
                           max_ttft_growth)
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
