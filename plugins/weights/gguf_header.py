"""A GGUF file's header as plain Python values: its metadata fields and the type, shape and
place of each tensor, the file itself mapped copy-on-write (no tensor byte is read here).

The `gguf` package's reader keeps a numpy view of every value it parses: a 49k-token
vocabulary costs it ~400k small arrays (160 MiB and seconds, for a 98 MiB model file).
This reads the same header in one pass into lists and strings.

Layout (little-endian; GGUF versions 2 and 3): magic "GGUF", u32 version, u64 tensor count,
u64 field count; each field a string key, a u32 value type and the value; each tensor a
string name, u32 dim count, u64 dims (the row length first), u32 ggml type, u64 offset into
the data section, which starts at the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value type -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
            11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: `dims` as GGUF lists them, the row length first; `start` the byte
    offset of its data in the file."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    start: int


@dataclass
class GGUFHeader:
    """Metadata fields (key -> int, float, bool, str, or a list of them) and tensor entries of
    a mapped GGUF file."""

    fields: dict[str, Any]
    tensors: list[TensorInfo]
    data: mmap.mmap

    def tensor_bytes(self, start: int, count: int) -> np.ndarray:
        """`count` bytes of the mapped file from `start`, as a writable uint8 array (writes
        stay in this process: the mapping is copy-on-write)."""
        return np.frombuffer(self.data, dtype=np.uint8, count=count, offset=start)


class _Cursor:
    """Reads values one after another from a buffer, never past its end."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos = data, 0

    def take(self, size: int) -> int:
        """Advance past `size` bytes; return where they start."""
        if size < 0 or self.pos + size > len(self.data):
            raise ValueError(f"the header runs past the file's end ({len(self.data)} bytes)")
        start, self.pos = self.pos, self.pos + size
        return start

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack_from("<" + fmt, self.data, self.take(size))[0]

    def string(self) -> str:
        size = self.scalar("Q")
        start = self.take(size)
        raw = self.data[start:start + size]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"a string at byte {start} is not UTF-8") from None

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.scalar(_SCALARS[kind])

    def array(self) -> list[Any]:
        kind, count = self.scalar("I"), self.scalar("Q")
        if kind in _SCALARS:  # numbers in one read
            dtype = np.dtype("<" + _SCALARS[kind])
            start = self.take(count * dtype.itemsize)
            return np.frombuffer(self.data, dtype=dtype, count=count, offset=start).tolist()
        if count > len(self.data):  # each element takes a byte at least
            raise ValueError(f"an array of {count} elements is longer than the file")
        return [self.value(kind) for _ in range(count)]


def read_header(path: Path) -> GGUFHeader:
    """Map `path` and read its header; ValueError names what is wrong with a bad one."""
    with path.open("rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    cursor = _Cursor(data)
    if data[:4] != b"GGUF":
        raise ValueError("it does not start with GGUF's magic bytes")
    version = cursor.scalar("4xI")
    if version & 0xFFFF == 0:
        raise ValueError("it is a big-endian GGUF file, which pkv does not read")
    if version not in (2, 3):
        raise ValueError(f"it is GGUF version {version}; pkv reads versions 2 and 3")
    tensor_count, field_count = cursor.scalar("Q"), cursor.scalar("Q")
    fields: dict[str, Any] = {}
    for _ in range(field_count):
        key = cursor.string()
        fields[key] = cursor.value(cursor.scalar("I"))
    entries = [_tensor_entry(cursor) for _ in range(tensor_count)]
    alignment = fields.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = [TensorInfo(name, dims, kind, data_start + offset)
               for name, dims, kind, offset in entries]
    return GGUFHeader(fields, tensors, data)


def _tensor_entry(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    n_dims = cursor.scalar("I")
    if n_dims > _MAX_DIMS:
        raise ValueError(f"tensor {name} has {n_dims} dimensions (at most {_MAX_DIMS})")
    dims = tuple(cursor.scalar("Q") for _ in range(n_dims))
    return name, dims, cursor.scalar("I"), cursor.scalar("Q")
