"""The disk tier's files: one file per KV block, an in-memory index, LRU deletion by size.

A file is named by the hex SHA-256 of (model fingerprint, block hash), so another model (or
another KV layout) sharing the folder never finds it, and holds:

    [ header: magic, version, key length, payload length, CRC-32 ] [ key ] [ payload ]

The key is everything the block's hash stands for (fingerprint, hash, parent hash, token ids,
salt); a read compares it byte for byte with the key asked for, as BlockPool.lookup confirms a
RAM hit, so neither a hash collision nor another tenant's salt can hand out foreign KV. The
CRC covers key and payload; files are written under a temporary name and renamed into place,
so a crash leaves either no file or a whole one, and a torn or corrupt file (short, bad CRC,
bad header) is deleted when read and counts as a miss.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import zlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pkv.core.sched.block_pool import BlockKey

logger = logging.getLogger("pkv.kv_offload")

MAGIC = b"PKVKVBLK"
VERSION = 1
# magic, version, key length, payload length, CRC-32 of key + payload
HEADER = struct.Struct("<8sHIQI")
SUFFIX = ".kv"


def encode_key(fingerprint: bytes, block_hash: bytes, key: BlockKey) -> bytes:
    """The exact bytes a file's key must equal: every field length-prefixed, unambiguous."""
    parent, token_ids, extra = key
    parts = [fingerprint, block_hash, parent or b"", bytes(extra)]
    head = struct.pack("<4I", *(len(p) for p in parts))
    return head + b"".join(parts) + array("q", token_ids).tobytes()


def smallest_file(fingerprint: bytes, block_size: int, payload_bytes: int) -> int:
    """The bytes of the smallest file of a block (a block without a salt, a child block)."""
    digest = bytes(32)  # a SHA-256 block hash
    return HEADER.size + len(encode_key(fingerprint, digest, (digest, [0] * block_size, b""))) \
        + payload_bytes


def file_id(fingerprint: bytes, block_hash: bytes) -> str:
    """The file's name without its suffix."""
    return hashlib.sha256(fingerprint + block_hash).hexdigest()


@dataclass(slots=True)
class FileStats:
    """What the files have seen (counters only grow; bytes_used is the folder's current size)."""

    writes: int = 0
    write_errors: int = 0
    corrupt: int = 0  # files found torn or damaged on read (deleted)
    evictions: int = 0  # files deleted to stay under the size cap
    bytes_used: int = 0


class OffloadFiles:
    """The folder of block files and its LRU index. Thread-safe: the writer thread adds
    files, the engine thread reads them; both may delete."""

    def __init__(self, directory: str | Path, max_bytes: int) -> None:
        self.dir = Path(directory).expanduser()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"kv_offload_dir {directory}: cannot make the folder "
                             f"({exc.strerror or exc})") from None
        self.max_bytes = max_bytes
        self.stats = FileStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file id -> size, oldest first
        self._rebuild()

    def _rebuild(self) -> None:
        """Index the folder's files, least recently used (mtime) first; drop leftovers."""
        found = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.endswith(".tmp"):  # a write a crash interrupted
                _unlink(entry.path)
            elif name.endswith(SUFFIX) and len(name) == 64 + len(SUFFIX):
                st = entry.stat()
                found.append((st.st_mtime_ns, name[:64], st.st_size))
        for _, fid, size in sorted(found):
            self._index[fid] = size
            self.stats.bytes_used += size
        with self._lock:
            self._shrink(0)

    def __contains__(self, fid: str) -> bool:
        return fid in self._index

    def __len__(self) -> int:
        return len(self._index)

    def _path(self, fid: str) -> Path:
        return self.dir / (fid + SUFFIX)

    def write(self, fid: str, key: bytes, payload: memoryview) -> bool:
        """Write one block's file atomically and index it; False if it cannot fit or fails."""
        size = HEADER.size + len(key) + payload.nbytes
        if size > self.max_bytes:  # (the tier's size holds a file of a block: a long salt's)
            with self._lock:
                self.stats.write_errors += 1
            return False
        crc = zlib.crc32(payload, zlib.crc32(key))
        path = self._path(fid)
        tmp = path.with_name(f"{fid}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, VERSION, len(key), payload.nbytes, crc))
                f.write(key)
                f.write(payload)
            # No fsync: after a power loss a renamed file may be short or zeroed, which the
            # length and CRC checks catch on read (a miss, never wrong KV).
            os.replace(tmp, path)
        except OSError as exc:
            _unlink(tmp)
            with self._lock:
                self.stats.write_errors += 1
                first = self.stats.write_errors == 1
            if first:  # (a full disk fails every write: said once, counted in /metrics)
                logger.warning("KV disk tier: cannot write %s: %s", path, exc)
            return False
        with self._lock:
            old = self._index.pop(fid, None)
            self.stats.bytes_used += size - (old or 0)
            self._index[fid] = size
            self.stats.writes += 1
            self._shrink(size)
        return True

    def read_into(self, fid: str, key: bytes, out: memoryview) -> bool:
        """Read a block's payload into `out` (exactly its size) if the file is whole and holds
        `key`; a damaged file is deleted. A hit becomes the most recently used file."""
        if fid not in self._index:
            return False
        path = self._path(fid)
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER.size + len(key))
                whole = self._whole(head, len(key), out.nbytes, os.fstat(f.fileno()).st_size)
                if whole and head[HEADER.size:] != key:
                    return False  # a whole file of other tokens (a hash collision): a miss
                if whole:
                    whole = (f.readinto(out) == out.nbytes and zlib.crc32(
                        out, zlib.crc32(key)) == HEADER.unpack_from(head)[4])
        except FileNotFoundError:  # deleted under us (LRU on the writer thread)
            self._forget(fid)
            return False
        except OSError:  # the file may be whole (too many open files, EIO): a miss, kept
            return False
        if not whole:
            with self._lock:
                self.stats.corrupt += 1
            self._forget(fid)
            _unlink(path)
            return False
        self.touch(fid)
        return True

    def touch(self, fid: str) -> None:
        """Make a file the most recently used (a hit, or its block evicted from RAM again)."""
        with self._lock:
            if fid not in self._index:
                return
            self._index.move_to_end(fid)
        try:  # the LRU order survives a restart through mtimes
            os.utime(self._path(fid))
        except OSError:
            pass

    @staticmethod
    def _whole(head: bytes, key_len: int, payload_len: int, file_size: int) -> bool:
        """Whether the header is ours and the file is as long as it says (not torn)."""
        if len(head) != HEADER.size + key_len:
            return False
        magic, version, stored_key_len, length, _ = HEADER.unpack_from(head)
        return (magic == MAGIC and version == VERSION and stored_key_len == key_len
                and length == payload_len and file_size == HEADER.size + key_len + length)

    def _forget(self, fid: str) -> None:
        with self._lock:
            size = self._index.pop(fid, None)
            if size is not None:
                self.stats.bytes_used -= size

    def _shrink(self, keep: int) -> None:
        """Delete least recently used files until the folder fits (lock held); `keep` is
        the size of the file just written, which is never the one deleted."""
        while self.stats.bytes_used > self.max_bytes and len(self._index) > (1 if keep else 0):
            fid, size = self._index.popitem(last=False)
            self.stats.bytes_used -= size
            self.stats.evictions += 1
            _unlink(self._path(fid))


def _unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
