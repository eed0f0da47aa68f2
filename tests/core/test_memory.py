"""The native heap's report: glibc's totals move with what C code allocates and frees."""

import ctypes

import pytest

from pkv.core.worker.memory import (
    hold_freed_memory_until_idle,
    native_heap,
    release_free_memory,
    resident_by_kind,
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


def test_freed_blocks_are_reused_until_the_heap_is_released(heap_or_skip):
    import resource

    import torch

    def step_faults() -> int:  # a step's activations: three 8 MiB tensors, freed at its end
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        held = [torch.empty(8 << 20, dtype=torch.uint8).fill_(1) for _ in range(3)]
        del held
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    hold_freed_memory_until_idle()
    faults = [step_faults() for _ in range(10)]
    # glibc's defaults trim the heap's top at each step's end: 6,144 pages faulted in again
    # every step (~4,000 at the least); held, the steps settle on the same pages.
    assert max(faults[-3:]) < 400, faults
    held = resident_by_kind()["anon_bytes"]
    release_free_memory()
    assert held - resident_by_kind()["anon_bytes"] >= 16 << 20
