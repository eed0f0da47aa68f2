"""Linear layers whose storage is decided by a quantization method.

A `Linear` owns no weights of its own: its `LinearMethod` (plain float, AWQ, FP8, ...)
registers the parameters, copies checkpoint tensors into them, converts them after loading
and applies them. Fused layers (q/k/v, gate/up) are one `Linear` with several output
shards; each shard comes from its own checkpoint tensor. Under tensor parallelism a Linear
holds a slice: of its outputs (column-parallel) or of its inputs (row-parallel, whose
partial outputs are summed over ranks).

Checkpoint tensors may arrive lazily (a safetensors slice handle), so that a rank reads only
its own part of each tensor from disk.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pkv.core.parallel import TPGroup

if TYPE_CHECKING:
    from pkv.core.layers.lora import LoRASlots


@dataclass(frozen=True)
class ParamLayout:
    """Where a parameter keeps its output and input features, to place fused shards and cut
    tensor-parallel slices.

    `output_dim` is the axis that runs over outputs (None: not per output, e.g. a
    per-tensor scale); `pack` is how many outputs share one element along it. `input_dim`
    and `input_pack` say the same of inputs (AWQ scales hold one row per group of inputs).
    """

    output_dim: int | None
    pack: int = 1
    input_dim: int | None = None
    input_pack: int = 1


@dataclass(frozen=True)
class LinearSplit:
    """A tensor-parallel cut: `column` keeps slices of the outputs (one (start, count) per
    fused shard, in checkpoint rows), `row` one (start, count) slice of the inputs."""

    kind: str
    slices: tuple[tuple[int, int], ...]
    tp: TPGroup


def as_tensor(tensor: Any) -> torch.Tensor:
    """A checkpoint tensor, read in full if it is a lazy slice handle."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor[:]


def take(tensor: Any, dim: int, start: int, count: int) -> torch.Tensor:
    """Rows start..start+count of `dim`, reading only those from a lazy handle."""
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(dim, start, count)
    index = [slice(None)] * len(tensor.get_shape())
    index[dim] = slice(start, start + count)
    return tensor[tuple(index)]


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

    def set_activations(self, activations: str) -> None:
        """Compute with activations of this precision (`EngineConfig.awq_activations`):
        float32 everywhere; methods with integer kernels (AWQ on CPU) also take int16."""
        if activations != "float32":
            raise ValueError(f"awq_activations={activations} needs an AWQ checkpoint; this "
                             f"model's linear layers are {self.name}")

    def load(self, layer: Linear, name: str, tensor: torch.Tensor, shard: int | None,
             full_name: str) -> None:
        """Copy one checkpoint tensor (a whole parameter or one fused shard) into place."""
        param = getattr(layer, name)
        layout = layer.layouts[name]
        if shard is not None and layout.output_dim is not None:
            rows = layer.shard_rows(shard)
            param = param.narrow(layout.output_dim, rows.start // layout.pack,
                                 (rows.stop - rows.start) // layout.pack)
        check_shape(param, tensor, full_name)
        param.copy_(tensor)

    def rank_part(self, layer: Linear, name: str, tensor: Any, shard: int | None) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (all of it without tensor parallelism)."""
        layout, split = layer.layouts[name], layer.split
        if split is None:
            return as_tensor(tensor)
        if split.kind == "column" and layout.output_dim is not None:
            start, count = split.slices[shard or 0]
            return take(tensor, layout.output_dim, start // layout.pack, count // layout.pack)
        if split.kind == "row" and layout.input_dim is not None:
            start, count = split.slices[0]
            return take(tensor, layout.input_dim, start // layout.input_pack,
                        count // layout.input_pack)
        return as_tensor(tensor)

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Convert the loaded checkpoint layout into the one `apply` wants (default: none)."""


def check_shape(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"the model expects {tuple(param.shape)}")


class Linear(nn.Module):
    """x @ W^T + b with W stored the way `method` chooses; `out_sizes` lists fused shards."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool,
                 method: LinearMethod | None = None, dtype: torch.dtype | None = None,
                 split: LinearSplit | None = None) -> None:
        """`in_features` and `out_sizes` are this rank's sizes (after any `split`)."""
        super().__init__()
        self.in_features = in_features
        self.out_sizes = list(out_sizes)
        self.out_features = sum(out_sizes)
        self.split = split
        if split is not None and split.kind == "row" and bias:
            raise ValueError("row-parallel layers with a bias are not supported")
        self.method = method or UnquantizedLinearMethod()
        dtype = dtype or torch.get_default_dtype()
        self.layouts = self.method.create_weights(self, dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype),
                                     requires_grad=False)
            self.layouts["bias"] = ParamLayout(output_dim=0)
        else:
            self.bias = None
        self.lora: LoRASlots | None = None  # adapter slots, where LoRA serving is on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        if self.lora is not None and self.lora.batch.segments:
            self.lora.add_delta(x, y)
        if self.split is not None and self.split.kind == "row":
            self.split.tp.all_reduce(y)  # each rank multiplied its slice of the inputs
        return y

    def load(self, name: str, tensor: Any, shard: int | None, full_name: str) -> None:
        if name in self.method.ignored:
            return
        if name not in self.layouts:
            raise ValueError(f"checkpoint tensor {full_name!r} has no place in the model "
                             f"({self.method.name} layers hold {', '.join(self.layouts)})")
        part = self.method.rank_part(self, name, tensor, shard)
        self.method.load(self, name, part, shard, full_name)

    def shard_rows(self, shard: int | None) -> slice:
        """The rows of fused output shard `shard` (all rows for None)."""
        if shard is None:
            return slice(0, self.out_features)
        start = sum(self.out_sizes[:shard])
        return slice(start, start + self.out_sizes[shard])

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_sizes}, bias={self.bias is not None}, "
                f"method={self.method.name}")


# oneDNN picks its blocked layout for this many rows; 16 was best or near it for every
# SmolLM2 shape at 1, 64 and 256 rows (a hint of 256 cost 20% at batch 256 on qkv).
PACK_HINT_ROWS = 16


class UnquantizedLinearMethod(LinearMethod):
    """Float weights [out, in], as nn.Linear."""

    name = "float"

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> dict[str, ParamLayout]:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features,
                                                dtype=dtype), requires_grad=False)
        return {"weight": ParamLayout(output_dim=0, input_dim=1)}

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        packed = layer._buffers.get("packed_weight")
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
        return F.linear(x, layer.weight, layer.bias)


# Entries kept by each of oneDNN's and ideep's shape-keyed caches (see prepack_linears).
ONEDNN_CACHE_ENTRIES = 64


def prepack_linears(model: nn.Module) -> int:
    """Reorder the float32 CPU weights of plain linear layers into oneDNN's blocked layout,
    in place; return how many were packed.

    oneDNN's GEMM on packed weights runs 1.2-2x faster than MKL on the plain layout for every
    SmolLM2 shape at 1-256 rows (FACTS: CPU GEMM). Packed layers drop their plain weight, so
    this is for serving, after loading; code that edits weights (quantize/) never calls it. A
    tied LM head gets its own packed copy; the embedding keeps the plain one.
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    # oneDNN keeps a primitive per (shape, rows), and torch's ideep layer above it a
    # computation per (weight, rows), each 0.3-1 MiB; rows change every step. At their
    # defaults of 1024 entries each, a serving process grew by ~200 MiB in 10 minutes and
    # kept climbing ~4 MiB a minute for as long as new row counts came. 64 recent ones cost
    # no measurable speed. Both are read once, at first use: this is before it.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_ENTRIES))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(ONEDNN_CACHE_ENTRIES))
    count = 0
    for module in model.modules():
        if not isinstance(module, Linear) or not isinstance(module.method, UnquantizedLinearMethod):
            continue
        weight = module.weight
        if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
            continue
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=PACK_HINT_ROWS)
        module.weight = None
        module.register_buffer("packed_weight", packed, persistent=False)
        count += 1
    return count
