"""`cpu` attention backend: a C++ kernel (csrc/paged_attention_cpu.cpp) that reads K/V
straight through the block tables, built once with torch.utils.cpp_extension and cached."""

from __future__ import annotations

import hashlib
import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from pkv.core.attention import AttentionMetadata
from pkv.plugins.attention.torch_backend import TorchAttentionBackend

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "paged_attention_cpu.cpp"


def unusable_reasons(device: str) -> list[str]:
    """Why the kernel cannot be built here (empty: it can)."""
    from torch.utils.cpp_extension import is_ninja_available

    reasons = []
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        reasons.append(f"no C++ compiler ({compiler}) on PATH")
    if not is_ninja_available():
        reasons.append("ninja is not installed")
    if not SOURCE.is_file():
        reasons.append(f"kernel source {SOURCE} is missing")
    return reasons


def _build_name() -> str:
    """Extension name keyed by the CPU's features: a -march=native build from one machine
    must never be loaded on another with fewer instructions."""
    flags = ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    key = " ".join(sorted(flags.split())) or torch.backends.cpu.get_cpu_capability()
    return f"pkv_paged_attention_cpu_{hashlib.sha256(key.encode()).hexdigest()[:10]}"


@lru_cache(maxsize=1)
def load_kernel() -> Any:
    """Compile (first time only, ~1 min) and import the extension."""
    from torch.utils.cpp_extension import load

    from rich.console import Console

    with Console(stderr=True).status("building the CPU attention kernel (cached after once)"):
        return load(name=_build_name(), sources=[str(SOURCE)],
                    extra_cflags=["-O3", "-fopenmp", "-march=native"],
                    extra_ldflags=["-fopenmp"], verbose=False)


class CPUAttentionBackend(TorchAttentionBackend):
    """float32 paged attention in C++ (other dtypes use the torch reference path)."""

    name = "cpu"

    def __init__(self) -> None:
        reasons = unusable_reasons("cpu")
        if reasons:
            raise RuntimeError("; ".join(reasons))
        self.kernel = load_kernel()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if q.dtype != torch.float32 or q.device.type != "cpu":
            return super().forward(q, k, v, k_cache, v_cache, meta, scale)
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        self.kernel.paged_attention(out, q.contiguous(), k_cache, v_cache, meta.block_tables,
                                    meta.seq_ids, meta.kv_lens, scale)
        return out
