"""KVOffloadStore: a disk tier under the prefix cache (`kv_offload_dir`).

    BlockPool.allocate evicts a hashed block ─► save(): memcpy its bytes into a staging buffer
        ─► queue ─► writer thread: file (kv_offload_files.py), LRU by size
    KVCacheCoordinator.get_computed_blocks misses RAM ─► has(), then load(): read + verify
        the file ─► ModelRunner.load_kv_blocks copies it into a fresh block before the forward

Eviction happens while the scheduler allocates, before the next forward overwrites the block,
so the memcpy at that moment sees the block's final bytes; the step never waits on the disk
for a write (a full staging area drops the write and counts it). The KV pool is handled as
raw bytes, whatever its dtype and row layout: `kv.view(torch.uint8)[:, :, block_id]`.
Split over ranks (`remote`: core/worker/kv_parts.py) a file holds every rank's part of the
block; the engine takes the blocks evicted while it scheduled a step (`hand_over`), the ranks
send their parts with that step, and `finish` queues the whole blocks' writes.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from pkv.core.sched.block_pool import BlockKey
from pkv.core.sched.kv_offload_files import OffloadFiles, encode_key, file_id

_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".json")


def model_fingerprint(model_path: Path, layout: dict[str, Any]) -> bytes:
    """What makes two processes' KV of the same tokens identical: the weights' files (name,
    size, mtime), the model's path, and `layout` (dtypes, quantization, KV shape, ...)."""
    h = hashlib.sha256()
    path = Path(model_path).resolve()
    h.update(str(path).encode())
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    for f in files:
        st = f.stat()
        h.update(f"\n{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(json.dumps(layout, sort_keys=True, default=str).encode())
    return h.digest()


@dataclass(slots=True)
class OffloadStats:
    """The disk tier's counters (bytes_used and files are current values)."""

    hits: int = 0  # blocks read back from disk into the pool
    saved_tokens: int = 0  # prefill tokens those blocks spared
    writes: int = 0
    drops: int = 0  # evicted blocks not saved: staging full
    corrupt: int = 0  # torn or damaged files found (deleted, counted as misses)
    write_errors: int = 0  # writes that failed (a full or vanished disk)
    evictions: int = 0  # files deleted to stay under kv_offload_size
    bytes_used: int = 0
    files: int = 0


class _Staging:
    """Reusable host buffers of one block each, at most `limit` in use, and the blocks queued
    for writing (file id -> encoded key, staged bytes: a lookup before the write lands reads
    them). Shared by the engine thread and the writer thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lock = threading.Lock()
        self.free: list[torch.Tensor] = []
        self.num_buffers = 0
        self.pending: dict[str, tuple[bytes, torch.Tensor]] = {}

    def copy_pending(self, fid: str, encoded_key: bytes) -> torch.Tensor | None:
        """A copy of a staged block's bytes if it holds exactly this key."""
        with self.lock:
            staged = self.pending.get(fid)
            if staged is None or staged[0] != encoded_key:
                return None
            return staged[1].clone()

    def take(self, nbytes: int, pin: bool) -> torch.Tensor | None:
        with self.lock:
            if self.free:
                return self.free.pop()
            if self.num_buffers >= self.limit:
                return None
            self.num_buffers += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def give_back(self, fid: str, buf: torch.Tensor) -> None:
        with self.lock:
            self.pending.pop(fid, None)
            self.free.append(buf)


def _write_loop(files: OffloadFiles, jobs: queue.Queue, staging: _Staging) -> None:
    """The writer thread: one job is (file id, key bytes, staged bytes)."""
    while True:
        job = jobs.get()
        try:
            if job is None:
                return
            fid, key, buf = job
            files.write(fid, key, memoryview(buf.numpy()))
            staging.give_back(fid, buf)
        finally:
            jobs.task_done()


def block_ids(due: list[Any]) -> list[int]:
    """The blocks of `KVOffloadStore.hand_over`'s entries."""
    return [block_id for *_, block_id in due]


class RemoteParts(Protocol):
    """The other ranks' parts of KV blocks (core/worker/kv_parts.py)."""

    @property
    def remote_bytes(self) -> int:
        """A block's bytes on the other ranks."""

    def fetch(self, block_ids: list[int]) -> torch.Tensor:
        """Their parts of the blocks, [blocks, remote_bytes], in rank order."""


class KVOffloadStore:
    """Saves evicted blocks to `directory` and reads them back, keyed by model fingerprint
    and chained block hash, confirmed against the block's full key."""

    def __init__(self, directory: str | Path, max_bytes: int, fingerprint: bytes,
                 kv: Callable[[], torch.Tensor], max_pending: int = 256,
                 remote: RemoteParts | None = None) -> None:
        """`kv` returns the runner's KV pool [layers, 2, num_blocks, block_size, heads, row]
        (asked each time: the pool may be reallocated); `max_pending` staging buffers of
        one block each bound the host memory waiting for the disk; `remote`: the rest of
        each block, held by other ranks."""
        self.files = OffloadFiles(directory, max_bytes)
        self.fingerprint = fingerprint
        self._kv = kv
        self._remote = remote
        # Blocks whose other parts are still on the other ranks: (file id, key, bytes, block).
        self._awaiting: list[tuple[str, bytes, torch.Tensor, int]] = []
        self._handed: set[str] = set()  # their files, handed over and not finished yet
        self._staging = _Staging(max(1, max_pending))
        self._jobs: queue.Queue = queue.Queue()
        self.hits = self.saved_tokens = self.drops = 0
        self._closed = False
        # The thread holds the files, the queue and the staging area, never this object, so
        # a dropped store (and the engine its `kv` closes over) is collected and stops it.
        self._thread = threading.Thread(target=_write_loop, name="pkv-kv-offload",
                                        args=(self.files, self._jobs, self._staging),
                                        daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._jobs.put, None)

    def _pool(self) -> torch.Tensor:
        return self._kv().view(torch.uint8)  # [L, 2, N, block_size, heads, row bytes]

    def _block_bytes(self, kv: torch.Tensor) -> int:
        """A block's bytes in a file: this pool's part and the other ranks'."""
        return kv[:, :, 0].numel() + (self._remote.remote_bytes if self._remote else 0)

    def save(self, block_hash: bytes, key: BlockKey, block_id: int, wait: bool = False) -> None:
        """Stage block `block_id` (holding `key`) for writing. The step's path never waits on
        the disk: with the staging area full the write is dropped, unless `wait` (shutdown)."""
        fid = file_id(self.fingerprint, block_hash)
        if fid in self.files:  # evicted again: the hotter for it
            self.files.touch(fid)
            return
        if (self._closed or fid in self._staging.pending
                or fid in self._handed or any(fid == f for f, *_ in self._awaiting)):
            return
        kv = self._pool()
        block = kv[:, :, block_id]
        nbytes = self._block_bytes(kv)
        buf = self._staging.take(nbytes, pin=kv.is_cuda)
        while buf is None and wait and self._thread.is_alive():
            self.complete()  # (blocks awaiting their other parts hold buffers)
            self.flush()
            buf = self._staging.take(nbytes, pin=kv.is_cuda)
        if buf is None:
            self.drops += 1
            return
        # A blocking copy: a lookup may read the staged bytes before the writer does (the
        # step that evicts has not launched its forward yet, so a GPU has nothing to wait on).
        buf[:block.numel()].view(block.shape).copy_(block)
        encoded = encode_key(self.fingerprint, block_hash, key)
        if self._remote is not None:
            self._awaiting.append((fid, encoded, buf, block_id))
            return
        self._stage(fid, encoded, buf)

    def hand_over(self) -> list[Any]:
        """The blocks saved since the last call whose other parts are still on other ranks
        (entries for `finish`; `block_ids` names their blocks). The engine asks the ranks
        for those parts with the step that may overwrite them."""
        due, self._awaiting = self._awaiting, []
        self._handed.update(fid for fid, *_ in due)
        return due

    def finish(self, due: list[Any], parts: torch.Tensor | None) -> None:
        """Queue the writes of `due` (from `hand_over`), completed with the other ranks'
        parts [blocks, remote_bytes]; None: they never came (the buffers go back)."""
        for i, (fid, encoded, buf, _) in enumerate(due):
            self._handed.discard(fid)
            if parts is None:
                self._staging.give_back(fid, buf)
                continue
            buf[buf.numel() - parts.shape[1]:].copy_(parts[i])
            self._stage(fid, encoded, buf)

    def complete(self) -> None:
        """Fetch the other ranks' parts of the blocks saved since the last call and queue
        their writes, between steps (at shutdown)."""
        due = self.hand_over()
        if due and self._remote is not None:
            self.finish(due, self._remote.fetch(block_ids(due)))

    def _stage(self, fid: str, encoded: bytes, buf: torch.Tensor) -> None:
        with self._staging.lock:
            self._staging.pending[fid] = (encoded, buf)
        self._jobs.put((fid, encoded, buf))

    def has(self, block_hash: bytes) -> bool:
        """Whether a file (or a write still staged) holds this block's hash; `load`
        confirms its key."""
        fid = file_id(self.fingerprint, block_hash)
        with self._staging.lock:
            if fid in self._staging.pending:
                return True
        return fid in self.files

    def load(self, block_hash: bytes, key: BlockKey) -> torch.Tensor | None:
        """The block's bytes (pinned on a GPU machine) if a whole file holds exactly `key`."""
        fid = file_id(self.fingerprint, block_hash)
        encoded = encode_key(self.fingerprint, block_hash, key)
        staged = self._staging.copy_pending(fid, encoded)
        if staged is not None or fid not in self.files:
            return staged  # (evicted so recently that its write has not landed yet)
        kv = self._pool()
        buf = torch.empty(self._block_bytes(kv), dtype=torch.uint8, pin_memory=kv.is_cuda)
        if not self.files.read_into(fid, encoded, memoryview(buf.numpy())):
            return None
        return buf

    def record_hits(self, num_blocks: int, num_tokens: int) -> None:
        """Count blocks that went into the pool from disk and the prefill they spared."""
        self.hits += num_blocks
        self.saved_tokens += num_tokens

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait (at most `timeout` seconds) until every staged write is on disk."""
        with self._jobs.all_tasks_done:
            return self._jobs.all_tasks_done.wait_for(lambda: not self._jobs.unfinished_tasks,
                                                      timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Finish pending writes and stop the writer thread."""
        self._closed = True
        if self._thread.is_alive():
            self.flush(timeout)
            self._finalizer()  # puts the stop marker, once
            self._thread.join(timeout)

    @property
    def stats(self) -> OffloadStats:
        f = self.files.stats
        return OffloadStats(self.hits, self.saved_tokens, f.writes, self.drops, f.corrupt,
                            f.write_errors, f.evictions, f.bytes_used, len(self.files))
