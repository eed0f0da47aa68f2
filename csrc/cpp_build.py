"""Build the C++ kernels in csrc/ with torch.utils.cpp_extension: one module per ISA flavour.

Every kernel is compiled into one module (`csrc/kernels_cpu.cpp`), for one of four ISA
flavours: `avx512` (x86-64-v4), `avxvnni` (x86-64-v3 with AVX-VNNI's 256-bit byte dot
products: Intel's cores since Alder Lake and Sapphire Rapids, Xeon 6 E-cores without
AVX-512), `avx2` (x86-64-v3: AVX2, FMA, F16C) and `generic` (SSE2 on x86-64, NEON on aarch64).
By default the best flavour this CPU runs is built; `PKV_CPU_ISA` picks another (AVX2 code
runs on AVX-512 hardware), which is how one machine measures and tests what another runs.
Builds are cached by torch in its extensions directory, under a name that carries the flavour
and a hash of the csrc/ files (torch rebuilds when the source changes, but does not look at
what it includes).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

CSRC = Path(__file__).resolve().parent
SOURCE = CSRC / "kernels_cpu.cpp"
FLAVOURS = ("avx512", "avxvnni", "avx2", "generic")

# What /proc/cpuinfo must list for a flavour's -march (x86-64-v4 and v3 as GCC defines them).
_X86_NEEDS = {
    "avx512": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma"),
    "avxvnni": ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "avx_vnni"),
    "avx2": ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"),
    "generic": (),
}


@lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def runnable_flavours(flags: frozenset[str] | set[str] | None = None) -> list[str]:
    """The ISA flavours a CPU with these /proc/cpuinfo flags (default: this CPU's) executes,
    best first; `generic` runs everywhere."""
    if not _is_x86():
        return ["generic"]
    flags = _cpu_flags() if flags is None else flags
    return [f for f in FLAVOURS if all(flag in flags for flag in _X86_NEEDS[f])]


def selected_flavour(runnable: list[str] | None = None) -> str:
    """`PKV_CPU_ISA` if set (checked against the runnable flavours, default this CPU's), else
    the best flavour the CPU runs."""
    chosen = os.environ.get("PKV_CPU_ISA", "").strip().lower()
    runnable = runnable_flavours() if runnable is None else runnable
    if not chosen or chosen == "auto":
        return runnable[0]
    if chosen not in FLAVOURS:
        raise ValueError(f"PKV_CPU_ISA={chosen!r}: choose one of auto, {', '.join(FLAVOURS)}")
    if chosen not in runnable:
        raise ValueError(f"PKV_CPU_ISA={chosen}: this CPU cannot run it "
                         f"(it runs {', '.join(runnable)})")
    return chosen


def compile_flags(flavour: str) -> list[str]:
    """The code-generation flags of a flavour on this machine's architecture."""
    if not _is_x86():
        return ["-march=armv8-a"] if platform.machine().lower() in ("aarch64", "arm64") else []
    march = {"avx512": "x86-64-v4", "avxvnni": "x86-64-v3", "avx2": "x86-64-v3",
             "generic": "x86-64"}[flavour]
    flags = [f"-march={march}", "-mtune=native"]
    if flavour == "avxvnni":
        flags.append("-mavxvnni")
    if flavour == "avx512":
        # GCC's tuning for Sapphire Rapids and Ice Lake servers prefers 256-bit vectors for
        # the loops it vectorizes itself (paged attention's came out in ymm there); the
        # avx512 flavour means 512.
        flags.append("-mprefer-vector-width=512")
        if "avx512_vnni" in _cpu_flags():  # byte dot products in one instruction, not three
            flags.append("-mavx512vnni")
        if "avx512vbmi" in _cpu_flags():  # byte permutes across a register (vpermt2b)
            flags.append("-mavx512vbmi")
    return flags


def unusable_reasons() -> list[str]:
    """Why the kernels cannot be built here (empty: they can)."""
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


def _source_hash(flags: list[str], csrc: Path = CSRC) -> str:
    """Names the build: its flags, its sources, and where they and torch's headers are. The
    build folder's ninja file holds those paths, so two installs of the same source (two
    clones, two venvs) sharing one folder would rebuild it in turn at every start."""
    import torch

    digest = hashlib.sha256(" ".join(flags).encode())
    digest.update(f"{csrc.resolve()}|{Path(torch.__file__).resolve().parent}".encode())
    for path in sorted(csrc.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:10]


def kernels(flavour: str | None = None) -> Any:
    """The kernels module for `flavour` (default: `selected_flavour()`); compiled the first
    time (about a minute) and cached by torch after that."""
    return _kernels(flavour or selected_flavour())


@lru_cache(maxsize=None)
def _kernels(flavour: str) -> Any:
    from rich.console import Console
    from torch.utils.cpp_extension import _get_build_directory, load

    if flavour not in runnable_flavours():
        raise ValueError(f"this CPU cannot run {flavour} code")
    reasons = unusable_reasons()
    if reasons:
        raise RuntimeError(f"cannot build the CPU kernels: {'; '.join(reasons)}")
    flags = compile_flags(flavour)
    name = f"pkv_kernels_{flavour}_{_source_hash(flags)}"
    build_dir = Path(_get_build_directory(name, verbose=False))
    status = f"building the CPU kernels for {flavour} (cached after once)"
    with Console(stderr=True).status(status), build_lock(build_dir):
        return load(name=name, sources=[str(SOURCE)], extra_cflags=["-O3", "-fopenmp", *flags],
                    extra_ldflags=["-fopenmp"], verbose=False)


@contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """pkv's own lock on a build folder, held while torch loads (or builds) from it. The OS
    drops it when its holder dies, so a torch `lock` found under it was left by a loader
    killed mid-way: it is removed at once (torch would wait on it, idle and silent)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "pkv.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logging.getLogger("pkv.kernels").warning(
                    "removing the build lock a killed process left: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def kernels_or_none(flavour: str | None = None) -> Any:
    """`kernels`, or None with a logged warning where nothing can build them (callers then
    compute the same in torch)."""
    try:
        return kernels(flavour)
    except ValueError:
        raise  # a PKV_CPU_ISA this CPU cannot run is the user's to fix, not to fall back from
    except Exception as exc:  # no compiler, no ninja, a failed build
        logging.getLogger("pkv.kernels").warning("CPU kernels unavailable (%s); using torch", exc)
        return None
