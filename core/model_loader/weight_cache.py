"""Converted-model cache: a GGUF file is converted once into a Hugging Face folder (config,
tokenizer, float32 safetensors) that later starts open instead of the GGUF.

For the bundled SmolLM2 reading the GGUF costs ~2.3 s of metadata parsing (gguf-py walks its
98k vocabulary and merge strings in Python) and ~1 s of Q4_1 dequantization; the converted
folder opens in ~0.2 s and its weights stream from the page cache. The folder is written
while the model loads (each tensor as it is dequantized, never a second copy in memory), under
a temporary name renamed into place only when complete, so a crash or a full disk leaves no
half-written cache. The key holds the GGUF's path, size and mtime: a changed file converts
again. `PKV_CACHE_DIR` moves the cache (default: $XDG_CACHE_HOME/pkv or ~/.cache/pkv).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

logger = logging.getLogger("pkv.cache")

# Bump when the folder layout or the conversion changes: old entries are then never read.
CACHE_VERSION = 1


def cache_root() -> Path:
    if env := os.environ.get("PKV_CACHE_DIR"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pkv"


def converted_folder(source_file: Path) -> Path:
    """Where the converted copy of `source_file` lives (it may not exist yet)."""
    st = source_file.stat()
    key = f"{source_file.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CACHE_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "converted" / f"{source_file.stem}-{digest}"


class SafetensorsStream:
    """A safetensors file written tensor by tensor: the header (names, shapes, offsets) first,
    then each float32 tensor's bytes as it arrives, in header order."""

    def __init__(self, file: BinaryIO, specs: list[tuple[str, tuple[int, ...]]]) -> None:
        self.file = file
        self.pending = list(reversed(specs))
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in specs:
            size = 4 * int(torch.Size(shape).numel())
            header[name] = {"dtype": "F32", "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        file.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, shape = self.pending.pop()
        if name != expected_name or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"cache writer expected {expected_name} {shape}, got {name} "
                             f"{tuple(tensor.shape)}")
        self.file.write(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())

    @property
    def complete(self) -> bool:
        return not self.pending


def convert_while_loading(tensors: Iterator[tuple[str, torch.Tensor]],
                          specs: list[tuple[str, tuple[int, ...]]], folder: Path,
                          write_metadata: Callable[[Path], None]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `tensors` unchanged while writing them, with `write_metadata`'s files, into
    `folder`. A cache that cannot be written (read-only home, full disk) is skipped with a
    log line; the load goes on either way."""
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        write_metadata(tmp)
        file: BinaryIO | None = (tmp / "model.safetensors").open("wb")
        stream = SafetensorsStream(file, specs)
    except OSError as exc:
        logger.info("not caching the converted model in %s: %s", folder, exc)
        shutil.rmtree(tmp, ignore_errors=True)
        yield from tensors
        return
    try:
        for name, tensor in tensors:
            if file is not None:
                try:
                    stream.write(name, tensor)
                except OSError as exc:
                    logger.info("not caching the converted model: %s", exc)
                    file.close()
                    file = None
            yield name, tensor
        if file is not None and stream.complete:
            file.close()
            file = None
            _publish(tmp, folder)
    finally:
        if file is not None:
            file.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, folder: Path) -> None:
    try:
        tmp.rename(folder)
        logger.info("cached the converted model in %s", folder)
    except OSError:  # another process (a tensor-parallel rank) published it first
        pass
