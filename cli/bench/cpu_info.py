"""The CPU a figure was measured on: every benchmark prints this line beside its numbers,
since kernels run different code on AVX2, AVX-512 and ARM machines."""

from __future__ import annotations

import platform
from pathlib import Path

from rich.console import Console

# The flags that decide which kernel code runs.
_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512vbmi",
          "avx512_vnni", "avx512_bf16", "amx_tile", "asimd", "sve")


def cpu_summary() -> str:
    """'<model> | kernels: <ISA flavour> | torch: <capability> | flags: ...' for the machine
    this runs on (the flavour pkv's C++ kernels are built for: PKV_CPU_ISA, or the best)."""
    import torch

    from pkv.csrc.cpp_build import selected_flavour

    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    capability = torch.backends.cpu.get_cpu_capability()
    shown = " ".join(f for f in _FLAGS if f in flags) or "none of interest"
    return f"{model} | kernels: {selected_flavour()} | torch: {capability} | flags: {shown}"


def print_cpu_line(console: Console, threads: bool = False) -> None:
    """'CPU: <cpu_summary()>' above a benchmark's figures; with `threads`, torch's thread count
    too (the micro-benchmarks, whose times depend on it)."""
    line = f"[bold]CPU[/]: {cpu_summary()}"
    if threads:
        import torch

        line += f"; {torch.get_num_threads()} torch threads"
    console.print(line)
