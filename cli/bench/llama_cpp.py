"""llama.cpp as a baseline on the same GGUF (`pkv bench --baseline llama.cpp`): its own
`llama-batched-bench` run on the workload's shape (B sequences of the prompt length, each
generating the output length) with pkv's thread count and, where llama.cpp has one like it,
pkv's KV cache type, read back into a BenchResult.

Nothing of llama.cpp ships with pkv: point `--llama-cpp` at a build's bin folder, or put
`llama-batched-bench` on PATH (docs/benchmarks.md says how to build one).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import psutil

from pkv.cli.bench.workload import BenchResult

BINARY = "llama-batched-bench"
# llama.cpp's KV cache type for pkv's `--kv-cache-dtype` where it has the same kind (int8:
# q8_0, 8-bit codes under a scale per 32 values there, per row here). Elsewhere (float32,
# fp8_e4m3) its default f16, its fast path: with an f32 cache its batched decode ran at ~0.45x.
CACHE_TYPES = {"float16": "f16", "bfloat16": "bf16", "int8": "q8_0"}


def cache_type(kv_format: str) -> str:
    """The `-ctk` / `-ctv` llama.cpp runs with beside pkv's KV format `kv_format`."""
    return CACHE_TYPES.get(kv_format, "f16")


def find_batched_bench(folder: str | None) -> Path:
    """`llama-batched-bench` in `folder`, else on PATH; a clear error where it is neither."""
    if folder is not None:
        path = Path(folder).expanduser() / BINARY
        if not path.is_file():
            raise ValueError(f"--llama-cpp {folder}: no {BINARY} there")
        return path
    found = shutil.which(BINARY)
    if found is None:
        raise ValueError(f"--baseline llama.cpp needs {BINARY}: give its folder with "
                         "--llama-cpp or put it on PATH")
    return Path(found)


def run_batched_bench(binary: Path, gguf: Path, batch: int, input_len: int, output_len: int,
                      threads: int, kv_type: str = "f16") -> BenchResult:
    """One llama-batched-bench run of `batch` sequences with a KV cache of `kv_type`; its peak
    RSS sampled while it runs. As pkv's, a sequence's first token comes from its prefill and
    the other `output_len - 1` from decode steps (-ntg counts decode steps only: with
    -ntg output_len llama.cpp ran a step more than pkv for the tokens credited)."""
    context = batch * (input_len + output_len) + 256
    decodes = output_len - 1
    command = [str(binary), "-m", str(gguf), "-t", str(threads), "-c", str(context),
               "-npp", str(input_len), "-ntg", str(decodes), "-npl", str(batch),
               "-ctk", kv_type, "-ctv", kv_type]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    peak = _watch_peak_rss(child)
    out = child.stdout.read() if child.stdout else ""
    if child.wait() != 0:
        tail = "\n".join(out.splitlines()[-5:])
        raise ValueError(f"{binary.name} failed on {gguf.name}: {tail}")
    row = parse_row(out)
    result = BenchResult("llama.cpp", batch, batch, row["T s"], batch * input_len,
                         batch * output_len, peak_rss_bytes=peak,
                         prefill_tokens=batch * input_len, prefill_s=row["T_PP s"],
                         decode_tokens=batch * decodes, decode_s=row["T_TG s"])
    return result


def parse_row(output: str) -> dict[str, float]:
    """The result row of llama-batched-bench's table, by column name (`T_PP s`, `S_TG t/s`,
    `T s`, ...)."""
    lines = [line for line in output.splitlines() if line.startswith("|")]
    header = next((line for line in lines if "S_TG" in line), None)
    if header is None or lines.index(header) + 2 >= len(lines):
        raise ValueError(f"no result table in {BINARY}'s output:\n{output[-500:]}")
    names = [cell.strip() for cell in header.strip("|").split("|")]
    cells = [cell.strip() for cell in lines[lines.index(header) + 2].strip("|").split("|")]
    return {name: float(cell) for name, cell in zip(names, cells)}


def _watch_peak_rss(child: subprocess.Popen, every_s: float = 0.02) -> int:
    """The child's largest RSS seen while it runs (its own VmHWM is gone once it exits)."""
    process, peak = psutil.Process(child.pid), 0
    while child.poll() is None:
        try:
            peak = max(peak, process.memory_info().rss)
        except psutil.Error:
            break
        time.sleep(every_s)
    return peak
