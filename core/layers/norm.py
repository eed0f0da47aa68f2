"""RMSNorm, Gemma's variant that scales by (1 + weight), and one over a vector split across
tensor-parallel ranks (OLMo 2's q/k norms over every head)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pkv.core.distributed.parallel import TPGroup
from pkv.core.layers.linear import as_tensor


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 whatever the dtype, as transformers does."""

    kernel: Any = None  # the compiled layer ops, set by `use_kernels`

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def scale(self) -> torch.Tensor:
        """What the normalized x is multiplied by."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dtype == torch.float32:
            if x.is_contiguous():
                out = torch.empty_like(x)
                self.kernel.rms_norm(out, x, self.scale(), self.eps)
                return out
            rows = x.unsqueeze(1) if x.dim() == 2 else x  # heads, or a slice of a fused qkv
            if rows.dim() == 3 and rows.stride(2) == 1 and rows.stride(1) == rows.shape[2]:
                out = torch.empty(rows.shape, dtype=x.dtype)
                self.kernel.head_rms_norm(out, rows, self.scale().contiguous(), self.eps)
                return out.view(x.shape)
        return self._reference(x)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.scale() * x32.to(x.dtype)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the kernel writes both in place."""
        if self.kernel is not None:
            self.kernel.add_rms_norm(x, residual, self.scale(), self.eps)
            return x, residual
        residual = residual + x
        return self.forward(residual), residual


class GemmaRMSNorm(RMSNorm):
    """Gemma stores the norm's weight as an offset from 1 (zeros at initialization)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def scale(self) -> torch.Tensor:
        return 1.0 + self.weight.float()

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.scale()).to(x.dtype)


class SplitRMSNorm(nn.Module):
    """RMSNorm over a vector of `size` values of which this rank holds `part` (start, count),
    and the weight's same slice: the mean square is summed over the ranks (one all-reduce of
    a value per row). Multiplies by the weight before rounding to the compute dtype, as
    OLMo 2's norm, its one user."""

    def __init__(self, size: int, part: tuple[int, int], eps: float, tp: TPGroup) -> None:
        super().__init__()
        self.size, (self.start, count) = size, part
        self.weight = nn.Parameter(torch.ones(count))
        self.eps = eps
        self.tp = tp

    def load(self, tensor: Any, name: str) -> None:
        """This rank's slice of the checkpoint's whole weight (a tensor or a lazy handle)."""
        tensor = as_tensor(tensor)
        if tuple(tensor.shape) != (self.size,):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the "
                             f"model expects ({self.size},)")
        self.weight.copy_(tensor[self.start:self.start + self.weight.numel()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True))
        return (self.weight * (x32 * torch.rsqrt(squares / self.size + self.eps))).to(x.dtype)
