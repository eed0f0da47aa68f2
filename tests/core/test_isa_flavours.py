"""The ISA flavours of the C++ kernels (csrc/cpp_build.py): which a CPU runs, how
PKV_CPU_ISA picks one, and greedy parity with transformers through the fused C++ decoder stack
under every flavour this machine executes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from pkv.cli.bench.cpu_info import cpu_summary
from pkv.core.config.engine import EngineConfig
from pkv.core.engine.llm_engine import LLMEngine
from pkv.csrc import cpp_build
from pkv.tests.helpers import check_matches_transformers, parity_prompts

AVX512_CPU = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "f16c",
              "bmi1", "bmi2", "movbe", "abm"}
ZEN3_CPU = AVX512_CPU - {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ALDER_LAKE_CPU = ZEN3_CPU | {"avx_vnni"}  # AVX-VNNI's 256-bit byte dot products, no AVX-512


@pytest.mark.skipif(not cpp_build._is_x86(), reason="x86 flags; other CPUs run generic only")
def test_runnable_flavours_follow_the_cpu_flags():
    assert cpp_build.runnable_flavours(AVX512_CPU) == ["avx512", "avx2", "generic"]
    assert cpp_build.runnable_flavours(ZEN3_CPU) == ["avx2", "generic"]
    assert cpp_build.runnable_flavours(ZEN3_CPU - {"fma"}) == ["generic"]
    assert cpp_build.runnable_flavours(ALDER_LAKE_CPU) == ["avxvnni", "avx2", "generic"]
    sapphire_rapids = AVX512_CPU | {"avx_vnni"}
    assert cpp_build.runnable_flavours(sapphire_rapids) == ["avx512", "avxvnni", "avx2", "generic"]


def test_pkv_cpu_isa_picks_a_flavour_the_cpu_runs(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PKV_CPU_ISA", raising=False)
    assert cpp_build.selected_flavour(["avx2", "generic"]) == "avx2"
    monkeypatch.setenv("PKV_CPU_ISA", "generic")
    assert cpp_build.selected_flavour(["avx2", "generic"]) == "generic"
    monkeypatch.setenv("PKV_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="cannot run it .it runs avx2, generic"):
        cpp_build.selected_flavour(["avx2", "generic"])
    monkeypatch.setenv("PKV_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="choose one of auto, avx512, avxvnni, avx2, generic"):
        cpp_build.selected_flavour()


def test_flavours_build_apart_and_name_themselves(cpu_kernels, isa: str):
    assert cpu_kernels.isa.startswith(isa)
    assert cpu_kernels.lanes == {"avx512": 16, "avxvnni": 8, "avx2": 8, "generic": 4}[isa]
    assert f"kernels: {isa}" in cpu_summary()


def test_bad_pkv_cpu_isa_is_one_line_in_the_cli(monkeypatch: pytest.MonkeyPatch):
    from typer.testing import CliRunner

    from pkv.cli.main import app

    result = CliRunner().invoke(app, ["plugins"], env={"PKV_CPU_ISA": "avx1024"})
    assert result.exit_code == 2
    assert "PKV_CPU_ISA='avx1024'" in result.output and "Traceback" not in result.output


def test_greedy_parity_with_transformers_under_each_flavour(tiny_llama_dir: Path, isa: str):
    # The first of check_matches_transformers' runs takes the fused C++ stack; one prompt is
    # long enough for the blockwise prefill attention.
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="4MiB"),
                       show_progress=False)
    assert engine.runner.model.model.fused is not None
    assert engine.runner.model.model.norm.kernel is cpp_build.kernels(isa)
    engine.shutdown()
    long_prompt = [(7 * i) % 500 + 3 for i in range(150)]
    check_matches_transformers(tiny_llama_dir, prompts=parity_prompts() + [long_prompt])


# What each x86 flavour's machine code may hold, read from the built library itself: AVX2 code
# must run on CPUs without AVX-512 (the test machines have it, so running alone proves
# nothing), and the kernels must really use the flavour's vector width.
_LEGACY_PREFIXES = {0x26, 0x2E, 0x36, 0x3E, 0x64, 0x65, 0x67}  # the ones VEX/EVEX may follow
_WIDEST = {"avx512": "zmm", "avxvnni": "ymm", "avx2": "ymm", "generic": "xmm"}


def _disassembly(library: str) -> dict[str, list[tuple[int, str]]]:
    """Per function (demangled name): each instruction's first opcode byte and its text."""
    done = subprocess.run(["objdump", "-d", "-C", "--wide", library], capture_output=True,
                          text=True, check=True)
    functions: dict[str, list[tuple[int, str]]] = {}
    current: list[tuple[int, str]] = []
    for line in done.stdout.splitlines():
        if header := re.match(r"^[0-9a-f]+ <(.*)>:$", line):
            current = functions.setdefault(header.group(1), [])
            continue
        fields = line.split("\t")
        if len(fields) < 3 or not fields[0].strip().endswith(":"):
            continue
        codes = [int(b, 16) for b in fields[1].split()]
        first = next((b for b in codes if b not in _LEGACY_PREFIXES), 0)
        current.append((first, fields[2]))
    return functions


@pytest.mark.skipif(not cpp_build._is_x86(), reason="x86 flavours; other CPUs run generic only")
def test_each_flavour_holds_only_its_instruction_set(cpu_kernels, isa: str):
    functions = _disassembly(cpu_kernels.__file__)
    code = [insn for body in functions.values() for insn in body]
    evex = [text for first, text in code if first == 0x62]  # 0x62 is EVEX in 64-bit mode
    vex = [text for first, text in code if first in (0xC4, 0xC5)]
    if isa != "avx512":
        assert not evex, f"{isa} build holds AVX-512 instructions: {evex[:5]}"
        assert not any(re.search(r"%zmm|%k[0-7]\b", text) for _, text in code)
    if isa == "generic":
        assert not vex, f"generic build holds AVX instructions: {vex[:5]}"
    # AVX-VNNI's byte and word dot products (VEX-encoded) are the avxvnni flavour's alone:
    # an AVX2-only CPU traps on them.
    vnni = [text for text in vex if re.search(r"vpdp(bu|ws)sd", text)]
    if isa == "avxvnni":
        tiles = [text for name, body in functions.items() if "tile_rows<" in name
                 for _, text in body]
        assert any(re.search(r"vpdpbusd .*%ymm", text) for text in tiles)
    else:
        assert not vnni, f"{isa} build holds AVX-VNNI instructions: {vnni[:5]}"
    # The batch-1 hot loops (AWQ GEMV, int8 LM head, decode attention) at the flavour's width.
    for kernel in ("::tile_rows<1l>(", "int8::(anonymous namespace)::gemv_rows<1l>(",
                   "paged_attention", "ggml::(anonymous namespace)::gemv_rows<"):
        bodies = [body for name, body in functions.items() if kernel in name]
        assert bodies, f"no {kernel} in the {isa} build"
        texts = [text for body in bodies for _, text in body]
        assert any(f"%{_WIDEST[isa]}" in text for text in texts), f"{kernel} is not vectorized"
        if isa == "generic":
            assert not any("%ymm" in text for text in texts)


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None,
                    reason="no aarch64 cross compiler (apt-get install g++-aarch64-linux-gnu)")
def test_kernels_cross_compile_for_aarch64_neon(tmp_path: Path):
    # The generic flavour is what ARM machines build (-march=armv8-a: NEON vectors of 4).
    from torch.utils.cpp_extension import include_paths

    obj = tmp_path / "kernels_arm.o"
    # -O1: what it checks is that the code compiles, inlined as it is at -O2 (an intrinsic's
    # immediate can come through an inline function), in two thirds of -O2's time.
    command = ["aarch64-linux-gnu-g++", "-std=c++20", "-O1", "-march=armv8-a", "-fopenmp",
               "-fPIC", "-DTORCH_EXTENSION_NAME=pkv_kernels_neon",
               *(f"-I{p}" for p in include_paths()),
               f"-I{sysconfig.get_paths()['include']}", "-c", str(cpp_build.SOURCE),
               "-o", str(obj)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    data = obj.read_bytes()
    assert data[:4] == b"\x7fELF" and int.from_bytes(data[18:20], "little") == 183  # AArch64
    assert b"generic (NEON)" in data


def test_a_killed_loaders_build_lock_is_cleared_and_a_live_one_waited_for(tmp_path: Path):
    # A loader killed mid-way leaves torch's `lock`, on which torch's load() would wait,
    # idle and silent; pkv's own lock (the OS drops it with its holder) tells the two apart.
    import threading

    stale = tmp_path / "lock"
    stale.write_text("")
    with cpp_build.build_lock(tmp_path):
        assert not stale.exists()  # nobody held pkv's lock: a killed loader's
        stale.write_text("")  # a live load's own
        entered = threading.Event()

        def second() -> None:
            with cpp_build.build_lock(tmp_path):
                entered.set()

        waiter = threading.Thread(target=second)
        waiter.start()
        assert not entered.wait(0.5)  # waits for the live load
        stale.unlink()  # the live load ends
    waiter.join(10)
    assert entered.is_set()


def test_two_copies_of_the_sources_build_apart(tmp_path: Path):
    # The build folder's ninja file names the sources' path: two clones (or venvs) sharing
    # one folder rebuilt it in turn at every start.
    import shutil

    copy = shutil.copytree(cpp_build.CSRC, tmp_path / "csrc")
    flags = cpp_build.compile_flags("generic")
    assert cpp_build._source_hash(flags) == cpp_build._source_hash(flags)
    assert cpp_build._source_hash(flags, copy) != cpp_build._source_hash(flags)
