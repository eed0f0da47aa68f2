"""The native heap: giving freed memory back to the operating system, and what it holds."""

from __future__ import annotations

import ctypes
import functools
import mmap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


class _MallInfo2(ctypes.Structure):
    # glibc >= 2.33 `struct mallinfo2`: totals over every arena, in bytes
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """glibc, or None where the C library is another (or absent)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None  # not glibc without it


def release_free_memory() -> None:
    """Hand freed memory back to the OS: glibc keeps freed heap pages (a busy minute of
    serving left ~50 MiB of them; repacking weights after loading ~190 MiB). Cheap; run after
    loading and whenever the engine goes idle."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_HELD_BLOCK_LIMIT = 32 << 20  # glibc's own ceiling for its adaptive mmap threshold


def hold_freed_memory_until_idle() -> None:
    """Keep memory freed during a step in the heap for the next one, up to blocks of 32 MiB;
    `release_free_memory` hands it back when the engine goes idle. glibc's defaults map each
    large block afresh and return the heap's top on a free, so a step's activations (an
    encoder's 64-sentence batch: ~24,000 pages, ~2 us each on this VM) were faulted in and
    zeroed again every step. Larger blocks (the KV pool, weights) stay mapped one by one."""
    libc = glibc()
    if libc is not None:
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
        libc.mallopt(_M_MMAP_THRESHOLD, _HELD_BLOCK_LIMIT)


@dataclass
class HeldHeap:
    """Bounds what the held heap keeps while the engine is busy: once the heap has grown
    `slack` bytes past its mark (its size at the first look, then at each hand-back), free
    pages go back to the OS (`malloc_trim`). Steps of one shape reuse the same freed blocks
    and never grow it; mixed prefill and decode steps do: a request's small long-lived
    allocations (token lists) land in the hole a prefill's 24 MiB block left, the next one
    no longer fits and extends the heap. At 64 x 1,024-token prompts this held ~760 MiB of
    free pages by the last prefill. Looks at most every `interval_s` (glibc's totals cost
    ~0.5 ms to gather from a fragmented heap)."""

    slack: int = 64 << 20
    interval_s: float = 0.5
    clock: Callable[[], float] = time.monotonic
    _mark: int | None = field(default=None, init=False)
    _next_look: float = field(default=0.0, init=False)

    def after_step(self) -> bool:
        """Hand free pages back if the heap outgrew its mark; True when it did."""
        now = self.clock()
        if now < self._next_look:
            return False
        self._next_look = now + self.interval_s
        heap = native_heap()
        if heap is None:
            return False
        if self._mark is None:
            self._mark = heap.heap_bytes
        if heap.heap_bytes <= self._mark + self.slack:
            return False
        # The mark is the heap's size before trimming: a step's working set regrows the
        # trimmed top without crossing it, so steady steps are never trimmed twice.
        self._mark = heap.heap_bytes
        release_free_memory()
        return True


@dataclass(frozen=True)
class NativeHeap:
    """glibc's heap summed over its arenas: what C, C++ and torch allocations hold."""

    heap_bytes: int  # taken from the OS by brk and arena heaps
    mmap_bytes: int  # large blocks mapped one by one
    in_use_bytes: int  # live small/medium allocations
    free_bytes: int  # freed but still held (fragments malloc_trim could not return)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def resident_by_kind() -> dict[str, int]:
    """The process's resident bytes split as Linux counts them: anonymous (heaps, tensors,
    stacks), file-backed (code and data of the libraries, paged in as paths first run) and
    shared memory; empty where /proc is not Linux's."""
    kinds = {"RssAnon": "anon_bytes", "RssFile": "file_bytes", "RssShmem": "shmem_bytes"}
    found = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in kinds:
                    found[kinds[key]] = int(value.split()[0]) * 1024  # kB
    except OSError:
        return {}
    return found


def native_heap() -> NativeHeap | None:
    """The allocator's totals (None where the C library is not glibc >= 2.33)."""
    libc = glibc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return None
    fn.restype = _MallInfo2
    info = fn()
    return NativeHeap(info.arena, info.hblkhd, info.uordblks, info.fordblks)


def resident_bytes(tensor: torch.Tensor) -> int | None:
    """Bytes of a CPU tensor's memory that are in RAM, page by page (`mincore`): a page comes
    in whole when its first byte is written, a 2 MB one too. None off glibc or off the CPU."""
    libc = glibc()
    if libc is None or tensor.device.type != "cpu" or tensor.nbytes == 0:
        return None
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.nbytes - start
    pages = (ctypes.c_ubyte * ((length + page - 1) // page))()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), pages) != 0:
        return None
    in_ram = torch.frombuffer(pages, dtype=torch.uint8).bitwise_and(1)  # bit 0: resident
    return int(in_ram.sum()) * page
