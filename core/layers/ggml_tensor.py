"""A weight in one of ggml's block formats, as a GGUF file stores it: quantized blocks of 32
or 256 values (Q4_0 ... Q8_0, the K-quants Q2_K ... Q6_K) or 16-bit floats, kept as the
file's bytes (a view of the mapped file where nothing had to move).

`GGMLTensor` goes where checkpoint tensors go. Layers that compute on the blocks
(`core/layers/ggml_linear.py`, the embedding) keep it as it is; anything else reads it as a
lazy handle does (`core.layers.linear.as_tensor`), which dequantizes it to float32.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch


class BlockFormat(NamedTuple):
    name: str
    values: int  # per block
    bytes: int  # per block


# ggml type id -> its block format (ggml-common.h); the csrc/ggml_cpu.cpp kernels read these.
FORMATS: dict[int, BlockFormat] = {
    0: BlockFormat("F32", 32, 128), 1: BlockFormat("F16", 32, 64),
    30: BlockFormat("BF16", 32, 64),
    2: BlockFormat("Q4_0", 32, 18), 3: BlockFormat("Q4_1", 32, 20),
    6: BlockFormat("Q5_0", 32, 22), 7: BlockFormat("Q5_1", 32, 24),
    8: BlockFormat("Q8_0", 32, 34),
    10: BlockFormat("Q2_K", 256, 84), 11: BlockFormat("Q3_K", 256, 110),
    12: BlockFormat("Q4_K", 256, 144), 13: BlockFormat("Q5_K", 256, 176),
    14: BlockFormat("Q6_K", 256, 210),
}
F32 = 0
_FLOAT_TYPES = {torch.float32: F32, torch.float16: 1, torch.bfloat16: 30}


@dataclass(frozen=True)
class GGMLTensor:
    """[rows, cols] values in ggml type `qtype`: `data` is uint8 [rows, row bytes], its rows
    possibly further apart than their bytes (a slice of the columns)."""

    data: torch.Tensor
    qtype: int
    cols: int

    def __post_init__(self) -> None:
        fmt = FORMATS.get(self.qtype)
        if fmt is None:
            raise ValueError(f"ggml type {self.qtype} is not one pkv computes with "
                             f"({', '.join(f.name for f in FORMATS.values())})")
        if self.cols % fmt.values or self.data.dim() != 2 or self.data.dtype != torch.uint8:
            raise ValueError(f"a {fmt.name} tensor needs uint8 rows of whole {fmt.values}-value "
                             f"blocks; got {self.cols} values per row")
        if self.data.shape[1] != self.cols // fmt.values * fmt.bytes:
            raise ValueError(f"a {fmt.name} row of {self.cols} values takes "
                             f"{self.cols // fmt.values * fmt.bytes} bytes, not "
                             f"{self.data.shape[1]}")

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> GGMLTensor:
        """A float tensor [rows, cols] (a multiple of 32 columns) as ggml's F32, or F16 / BF16
        where it is 16-bit: at its own size."""
        qtype = _FLOAT_TYPES.get(weight.dtype)
        if qtype is None:
            weight, qtype = weight.float(), F32
        weight = weight.detach().contiguous()
        rows, cols = weight.shape
        return cls(weight.view(torch.uint8).view(rows, cols * weight.element_size()), qtype, cols)

    @property
    def format(self) -> BlockFormat:
        return FORMATS[self.qtype]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.shape[0] * self.data.shape[1]

    def get_shape(self) -> list[int]:
        """The values' shape, as a lazy slice handle gives it."""
        return list(self.shape)

    def narrow(self, dim: int, start: int, count: int) -> GGMLTensor:
        """Rows start..start+count (dim 0), or columns (dim 1) in whole blocks."""
        if dim == 0:
            return GGMLTensor(self.data.narrow(0, start, count), self.qtype, self.cols)
        fmt = self.format
        if start % fmt.values or count % fmt.values:
            raise ValueError(f"a {fmt.name} tensor splits only between its {fmt.values}-value "
                             f"blocks; columns {start}..{start + count} cut one")
        return GGMLTensor(self.data.narrow(1, start // fmt.values * fmt.bytes,
                                           count // fmt.values * fmt.bytes), self.qtype, count)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]: by the CPU kernels, or by the gguf package where they did
        not build."""
        from pkv.csrc import cpp_build

        kernels = cpp_build.kernels_or_none()
        if kernels is not None:
            return kernels.ggml_dequantize(self.data, self.qtype, self.cols)
        floats = {code: dtype for dtype, code in _FLOAT_TYPES.items()}
        if self.qtype in floats:
            return self.data.contiguous().view(floats[self.qtype]).float()
        from gguf import quants

        values = quants.dequantize(np.ascontiguousarray(self.data.numpy()), self.qtype)
        return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(self.shape))

    def __getitem__(self, index: Any) -> torch.Tensor:
        """Values as float32 (a lazy handle's read; `[:]` is all of them)."""
        return self.dequantize()[index]


_MADV_DONTNEED = 4  # linux/mman.h


def drop_pages(data: torch.Tensor) -> None:
    """Tell the OS that the whole pages under `data` are no longer needed (Linux; elsewhere
    nothing happens): mapped from a file, they leave the process's memory and would be read
    again from the file; anonymous, they read back as zeros. For blocks a layer converted and
    will not read again."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    page = mmap.PAGESIZE
    start = -(-data.data_ptr() // page) * page
    end = (data.data_ptr() + data.nbytes) // page * page  # only pages wholly inside
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)
