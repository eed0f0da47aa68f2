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

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pkv.core.distributed.parallel import TPGroup
from pkv.core.layers.ggml_tensor import GGMLTensor


class AdapterSlots(Protocol):
    """Adapter deltas a linear adds to its output: LoRA's slots (pkv.core.lora.layers), which
    sit above this module and attach themselves to linears."""

    batch: Any  # this step's runs of rows by adapter; `segments` is empty when none has one

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's adapter product."""


@dataclass(frozen=True)
class FusedOperands:
    """What the C++ decoder (csrc/decoder_cpu.cpp) multiplies a linear with: the float32
    `[weight]`, or 4-bit AWQ's `[codes, scales, zs]` with its group size (0: float) and the
    bits of its GEMV's activations (32: float)."""

    tensors: list[torch.Tensor]
    group_size: int = 0
    activation_bits: int = 32


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


def take(tensor: Any, dim: int, start: int, count: int) -> Any:
    """Rows start..start+count of `dim`, reading only those from a lazy handle (a GGMLTensor
    stays one)."""
    if isinstance(tensor, (torch.Tensor, GGMLTensor)):
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
        float32 everywhere; methods with integer kernels (AWQ on CPU) also take int16, int8."""
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

    def fused_operands(self, layer: Linear) -> FusedOperands | None:
        """What the fused C++ decoder multiplies `layer` with; None (the default) where it
        has no kernel for this method, and the model runs its Python layer loop."""
        return None


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
        self.kernel: Any = None  # the CPU kernels module, where the method runs on it
        dtype = dtype or torch.get_default_dtype()
        self.layouts = self.method.create_weights(self, dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype),
                                     requires_grad=False)
            self.layouts["bias"] = ParamLayout(output_dim=0)
        else:
            self.bias = None
        self.lora: AdapterSlots | None = None  # adapter slots, where LoRA serving is on

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


class UnquantizedLinearMethod(LinearMethod):
    """Float weights [out, in], as nn.Linear."""

    name = "float"

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> dict[str, ParamLayout]:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features,
                                                dtype=dtype), requires_grad=False)
        return {"weight": ParamLayout(output_dim=0, input_dim=1)}

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        # On CPU in float32 the kernels' f32_linear (csrc/gemv_cpu.cpp): a GEMV that streams
        # the weight at memory speed up to a few rows, a GEMM above (csrc/gemm_cpu.cpp on AVX2
        # up to 256 rows, oneDNN's beyond), on this same weight.
        kernel = layer.kernel
        if kernel is not None and x.dim() == 2 and x.dtype == torch.float32:
            return kernel.f32_linear(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def fused_operands(self, layer: Linear) -> FusedOperands | None:
        weight = layer.weight  # csrc/gemv_cpu.cpp's f32_linear
        if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        return FusedOperands([weight.contiguous()])
