"""The gated MLP of every family here: down(act(gate(x)) * up(x)), gate and up fused."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pkv.core.distributed.parallel import ShardPlan
from pkv.core.layers.attention import tp_split
from pkv.core.layers.linear import Linear, LinearMethod

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}

# activation -> the layer-ops kernel that computes act(gate) * up in one pass
_FUSED = {"silu": "silu_and_mul", "swish": "silu_and_mul",
          "gelu_pytorch_tanh": "gelu_tanh_and_mul", "gelu_tanh": "gelu_tanh_and_mul"}


def check_activation(name: str, field: str = "hidden_act") -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"config field {field}={name!r} is not supported "
                         f"({', '.join(ACTIVATIONS)})")
    return name


class GatedMLP(nn.Module):
    kernel: Any = None  # the compiled layer ops, set by `use_kernels` (SiLU, GeGLU-tanh)

    def __init__(self, hidden_size: int, intermediate: tuple[int, int], act: str,
                 method: LinearMethod | None, plan: ShardPlan) -> None:
        """`intermediate` is this rank's (start, count) of the intermediate channels."""
        super().__init__()
        size = intermediate[1]
        self.gate_up_proj = Linear(hidden_size, [size, size], False, method,
                                   split=tp_split(plan, "column", intermediate, intermediate))
        self.down_proj = Linear(size, [hidden_size], False, method,
                                split=tp_split(plan, "row", intermediate))
        self.act = check_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = _FUSED.get(self.act)
        if self.kernel is not None and fused is not None and gate_up.dtype == torch.float32:
            h = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
            getattr(self.kernel, fused)(h, gate_up)
            return self.down_proj(h)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(ACTIVATIONS[self.act](gate) * up)
