"""Build the C++ kernels in csrc/ with torch.utils.cpp_extension, once per CPU model.

Builds are cached by torch in its extensions directory; the name carries a hash of the
CPU's feature flags, because a -march=native build must never load on a CPU with fewer
instructions, and of the csrc/ files the source includes (torch rebuilds when a source
changes, but does not look at what it includes).

`PKV_CPU_ARCH` (a -march value, e.g. `x86-64-v3` for AVX2 + FMA) builds for less than this
CPU has: how an AVX-512 machine measures the code an AVX2-only machine runs.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def unusable_reasons(source: Path) -> list[str]:
    """Why `source` cannot be built here (empty: it can)."""
    from torch.utils.cpp_extension import is_ninja_available

    reasons = []
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        reasons.append(f"no C++ compiler ({compiler}) on PATH")
    if not is_ninja_available():
        reasons.append("ninja is not installed")
    if not source.is_file():
        reasons.append(f"kernel source {source} is missing")
    return reasons


def _local_includes(source: Path) -> list[Path]:
    """The csrc/ files `source` includes, directly or through them."""
    found: list[Path] = []
    pending = [source]
    while pending:
        text = pending.pop().read_text()
        for name in re.findall(r'^#include "([^"]+)"', text, flags=re.MULTILINE):
            path = CSRC / name
            if path.is_file() and path not in found:
                found.append(path)
                pending.append(path)
    return sorted(found)


def _build_key(source: Path) -> str:
    flags = ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    key = " ".join(sorted(flags.split())) or torch.backends.cpu.get_cpu_capability()
    key += f" -march={target_arch()}"
    included = b"".join(path.read_bytes() for path in _local_includes(source))
    return hashlib.sha256(key.encode() + included).hexdigest()[:10]


def target_arch() -> str:
    """The -march the kernels are built for: this CPU's, unless PKV_CPU_ARCH says less."""
    arch = os.environ.get("PKV_CPU_ARCH", "native")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", arch):
        raise ValueError(f"PKV_CPU_ARCH={arch!r} is not a -march value (e.g. x86-64-v3)")
    return arch


@lru_cache(maxsize=None)
def build(source_name: str, what: str) -> Any:
    """Compile (first time only, about a minute) and import csrc/`source_name`."""
    from rich.console import Console
    from torch.utils.cpp_extension import load

    source = CSRC / source_name
    reasons = unusable_reasons(source)
    if reasons:
        raise RuntimeError(f"cannot build the {what}: {'; '.join(reasons)}")
    name = f"pkv_{source.stem}_{_build_key(source)}"
    with Console(stderr=True).status(f"building the {what} (cached after once)"):
        return load(name=name, sources=[str(source)],
                    extra_cflags=["-O3", "-fopenmp", f"-march={target_arch()}"],
                    extra_ldflags=["-fopenmp"], verbose=False)


def build_or_none(source_name: str, what: str) -> Any:
    """`build`, or None with a logged warning where nothing can build it (callers then
    compute the same in torch)."""
    import logging

    try:
        return build(source_name, what)
    except Exception as exc:  # no compiler, no ninja, a failed build
        logging.getLogger("pkv.kernels").warning("%s unavailable (%s); using torch", what, exc)
        return None
