"""Python objects between ranks (a step's inputs, a pipeline stage's messages), pickled so
that a tensor on a GPU arrives on the receiving rank's own GPU.

Torch pickles a CUDA tensor with its device: rank k would rebuild the driver's `cuda:0`
tensors on cuda:0 (a context on GPU 0 for every rank, then "expected all tensors on the same
device" in its first layer). Here such a tensor travels as host memory and is rebuilt on the
device the receiving rank set for itself (`torch.cuda.set_device`); CPU tensors stay CPU ones.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch


def _on_local_device(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that left its sender's GPU, on this process's GPU (the CPU where none)."""
    if torch.cuda.is_available():
        return tensor.to(torch.device("cuda", torch.cuda.current_device()))
    return tensor


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cuda":
            return _on_local_device, (obj.detach().cpu(),)
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """`obj` as bytes, its CUDA tensors as host memory to rebuild on the receiver's GPU."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """What `dumps` wrote, its GPU tensors on this process's GPU."""
    return pickle.loads(data)
