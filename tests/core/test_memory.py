"""The native heap's report: glibc's totals move with what C code allocates and frees."""

import ctypes
import mmap

import pytest
import torch

from pkv.core.worker.memory import (
    HeldHeap,
    glibc,
    native_heap,
    release_free_memory,
    resident_by_kind,
    resident_bytes,
)


@pytest.fixture
def heap_or_skip():
    if native_heap() is None:
        pytest.skip("not glibc >= 2.33: no mallinfo2")  # macOS, musl


def test_native_heap_sees_mapped_and_small_blocks(heap_or_skip):
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def live(heap):  # a big block is mapped, or carved from free heap space when there is some
        return heap.in_use_bytes + heap.mmap_bytes

    before = native_heap()
    big = libc.malloc(64 << 20)
    small = [libc.malloc(1024) for _ in range(4096)]  # 4 MiB of arena chunks
    during = native_heap()
    assert live(during) - live(before) >= 68 << 20
    assert during.in_use_bytes - before.in_use_bytes >= 4 << 20
    libc.free(big)
    for p in small:
        libc.free(p)
    release_free_memory()
    after = native_heap()
    assert live(during) - live(after) >= 68 << 20
    assert set(after.as_dict()) == {"heap_bytes", "mmap_bytes", "in_use_bytes", "free_bytes"}


def test_resident_memory_splits_into_anonymous_and_file_backed():
    import numpy as np

    before = resident_by_kind()
    if not before:
        pytest.skip("no /proc/self/status (not Linux)")
    touched = np.ones(32 << 20, dtype=np.uint8)  # 32 MiB of anonymous pages, written
    during = resident_by_kind()
    assert during["anon_bytes"] - before["anon_bytes"] >= 30 << 20
    assert during["file_bytes"] > 0  # the interpreter's own code at least
    del touched


# A step's activations (three 8 MiB tensors, freed at its end), ten steps, in a fresh
# interpreter: the faults depend on the heap's layout, which a test worker's earlier tests
# leave fragmented (there one 8 MiB block in two steps still came from a fresh mapping). With
# glibc's defaults each block is mapped afresh and the heap's top trimmed at a step's end
# (6,144 pages faulted in again a step until its thresholds adapt, here 4-5 steps).
_STEPS = """
import json, resource, sys
import torch
from pkv.core.worker.memory import (hold_freed_memory_until_idle, native_heap,
                                   release_free_memory, resident_by_kind)

def step_faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [torch.empty(8 << 20, dtype=torch.uint8).fill_(1) for _ in range(3)]
    del held
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

if sys.argv[1] == "held":
    hold_freed_memory_until_idle()
faults = [step_faults()]
kept = native_heap().free_bytes  # the first step's blocks, freed
faults += [step_faults() for _ in range(9)]
held = resident_by_kind()["anon_bytes"]
release_free_memory()
print(json.dumps({"faults": faults, "kept": kept,
                  "released": held - resident_by_kind()["anon_bytes"]}))
"""


def _steps(mode: str) -> dict:
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout)


def test_freed_blocks_are_reused_until_the_heap_is_released(heap_or_skip):
    # Held, a step's freed blocks stay in the heap (glibc's defaults unmap them), the steps
    # settle on the same pages, and release_free_memory hands them back.
    default, held = _steps("default"), _steps("held")
    assert default["kept"] < 8 << 20 <= 16 << 20 <= held["kept"], (default, held)
    assert max(held["faults"][-3:]) < 400, held
    assert held["released"] >= 16 << 20, held


# Steps whose freed blocks sit below a small allocation that outlives them (as a request's
# token list does), in a fresh interpreter: the heap grows, and HeldHeap hands it back.
_GROWING = """
import ctypes, json
import torch
from pkv.core.worker.memory import HeldHeap, hold_freed_memory_until_idle, resident_by_kind

hold_freed_memory_until_idle()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
now = [0.0]
held = HeldHeap(slack=2 << 20, interval_s=1.0, clock=lambda: now[0])
kept = []

def step(blocks, size=8 << 20):
    live = [torch.empty(size, dtype=torch.uint8).fill_(1) for _ in range(blocks)]
    kept.append(libc.malloc(4096))
    del live

def look(seconds):
    now[0] += seconds
    before = resident_by_kind()["anon_bytes"]
    trimmed = held.after_step()
    return [trimmed, before - resident_by_kind()["anon_bytes"]]

looks = {"first": look(0)}
step(3)
looks["too soon"] = look(0.5)
looks["grown"] = look(0.6)
# Fits in what the first step freed: half of one of its blocks (small allocations made
# while they were live may sit between them, so a whole block's size may not fit again).
step(1, 4 << 20)
looks["fits"] = look(1.0)
step(6)
looks["grown again"] = look(1.0)
print(json.dumps(looks))
"""


def test_held_heap_hands_back_what_growing_steps_left(heap_or_skip):
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _GROWING], capture_output=True, text=True,
                          timeout=120, check=True)
    looks = json.loads(done.stdout)
    assert [looks[k][0] for k in looks] == [False, False, True, False, True], looks
    assert looks["grown"][1] >= 16 << 20, looks  # the freed 24 MiB, less what glibc keeps
    assert looks["grown again"][1] >= 32 << 20, looks
    assert HeldHeap().after_step() is False  # a first look only sets the mark


def test_resident_bytes_counts_the_pages_written():
    if glibc() is None:
        pytest.skip("not glibc: no mincore through ctypes")
    page = mmap.PAGESIZE
    area = mmap.mmap(-1, 64 * page)  # anonymous: no page is in RAM until written
    t = torch.frombuffer(area, dtype=torch.uint8)
    assert resident_bytes(t) == 0
    t[0] = 1
    t[10 * page + 5] = 1
    t[10 * page + 9] = 1  # the same page again
    assert resident_bytes(t) == 2 * page
    assert resident_bytes(t[10 * page:11 * page]) == page  # a view: its own pages only
    assert resident_bytes(t[page:10 * page]) == 0
    assert resident_bytes(torch.empty(4, device="meta")) is None
    del t
    area.close()


def test_ranks_on_one_host_share_its_memory_utilization(monkeypatch) -> None:
    # Each rank took memory_utilization of the whole machine: two ranks reserved 1.8x it.
    from pkv.core.config.engine import EngineConfig
    from pkv.core.worker import kv_pool_size

    gib = 2**30
    monkeypatch.setattr(kv_pool_size, "_device_memory", lambda device: (10 * gib, gib))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    config = EngineConfig(memory_utilization=0.5)
    cpu = torch.device("cpu")
    ranks = kv_pool_size._ranks_sharing(cpu)
    assert ranks == 2
    # half of 5 GiB, less this rank's own 1 GiB, in blocks of 1 MiB
    assert kv_pool_size._blocks_from_utilization(config, cpu, 2**20, ranks) == 1536
    assert kv_pool_size._blocks_from_utilization(config, cpu, 2**20) == 4096  # one rank
