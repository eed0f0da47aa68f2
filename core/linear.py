"""Linear layers whose storage is decided by a quantization method.

A `Linear` owns no weights of its own: its `LinearMethod` (plain float, AWQ, FP8, ...)
registers the parameters, copies checkpoint tensors into them, converts them after loading
and applies them. Fused layers (q/k/v, gate/up) are one `Linear` with several output
shards; each shard comes from its own checkpoint tensor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ParamLayout:
    """Where a parameter keeps the output features, to place fused shards.

    `output_dim` is the axis that runs over outputs (None: not per output, e.g. a
    per-tensor scale); `pack` is how many outputs share one element along it.
    """

    output_dim: int | None
    pack: int = 1


class LinearMethod(ABC):
    """How a linear layer stores and multiplies its weights."""

    name: str = "abstract"
    # Checkpoint tensors this method accepts and does not need (e.g. FP8 input scales).
    ignored: frozenset[str] = frozenset()

    @abstractmethod
    def create_weights(self, layer: Linear, dtype: torch.dtype) -> dict[str, ParamLayout]:
        """Register the layer's parameters; return the checkpoint name -> layout of each."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """y = x @ W^T (+ bias), in x's dtype."""

    def load(self, layer: Linear, name: str, tensor: torch.Tensor, shard: int | None,
             full_name: str) -> None:
        """Copy one checkpoint tensor (a whole parameter or one fused shard) into place."""
        param = getattr(layer, name)
        layout = layer.layouts[name]
        if shard is not None and layout.output_dim is not None:
            offset = sum(layer.out_sizes[:shard]) // layout.pack
            param = param.narrow(layout.output_dim, offset, layer.out_sizes[shard] // layout.pack)
        check_shape(param, tensor, full_name)
        param.copy_(tensor)

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Convert the loaded checkpoint layout into the one `apply` wants (default: none)."""


def check_shape(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"the model expects {tuple(param.shape)}")


class Linear(nn.Module):
    """x @ W^T + b with W stored the way `method` chooses; `out_sizes` lists fused shards."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool,
                 method: LinearMethod | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_sizes = list(out_sizes)
        self.out_features = sum(out_sizes)
        self.method = method or UnquantizedLinearMethod()
        dtype = dtype or torch.get_default_dtype()
        self.layouts = self.method.create_weights(self, dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype),
                                     requires_grad=False)
            self.layouts["bias"] = ParamLayout(output_dim=0)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def load(self, name: str, tensor: torch.Tensor, shard: int | None, full_name: str) -> None:
        if name in self.method.ignored:
            return
        if name not in self.layouts:
            raise ValueError(f"checkpoint tensor {full_name!r} has no place in the model "
                             f"({self.method.name} layers hold {', '.join(self.layouts)})")
        self.method.load(self, name, tensor, shard, full_name)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_sizes}, bias={self.bias is not None}, "
                f"method={self.method.name}")


class UnquantizedLinearMethod(LinearMethod):
    """Float weights [out, in], as nn.Linear."""

    name = "float"

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> dict[str, ParamLayout]:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features,
                                                dtype=dtype), requires_grad=False)
        return {"weight": ParamLayout(output_dim=0)}

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)
