"""Weight-only int8 linear layers on CPU: the LM head of 4-bit models.

With 4-bit decoder weights the float32 LM head (SmolLM2: 49152 x 576, tied to the embedding)
is most of what a batch-1 step reads. Symmetric int8 with one scale per output keeps the
logits within ~0.5% of float (llama.cpp keeps 4-bit models' output layer at 6-8 bits for the
same reason) and reads a quarter of the bytes, through a fused GEMV (csrc/int8_cpu.cpp).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pkv.core.layers.linear import Linear, LinearMethod, ParamLayout

TILE = 32


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 codes [N, K], float32 scales [N]): w ~ codes * scale."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scale


def tile_codes(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the kernel's [N/32, K, 32] (N padded with zero rows to a multiple of 32)."""
    n, k = codes.shape
    padded = torch.zeros(-(-n // TILE) * TILE, k, dtype=torch.int8)
    padded[:n] = codes
    return padded.reshape(-1, TILE, k).transpose(1, 2).contiguous()


class Int8LinearMethod(LinearMethod):
    """Applies an int8 weight made by `convert` from a loaded float layer (not a checkpoint
    format: nothing is loaded into it)."""

    name = "int8"

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> dict[str, ParamLayout]:
        raise ValueError("int8 layers are converted from float ones (Int8LinearMethod.convert)")

    @classmethod
    def convert(cls, layer: Linear, weight: torch.Tensor) -> None:
        """Make `layer` (float, with `weight` [N, K]) an int8 layer; `weight` is not freed
        (a tied LM head shares it with the embedding)."""
        codes, scale = quantize_rows(weight.detach())
        n = weight.shape[0]
        layer.weight = None
        layer.codes = nn.Parameter(tile_codes(codes), requires_grad=False)
        pad = layer.codes.shape[0] * TILE - n
        layer.scale = nn.Parameter(torch.cat([scale, scale.new_ones(pad)]), requires_grad=False)
        layer.kernel = _cpu_kernel()
        layer.method = cls()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        # The LM head's x (2-D float32, every step) goes in as it is: each reshape, cast and
        # slice is one more dispatch, run cold after the step's weights (see flatten_batch).
        plain = x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
        x2 = x if plain else x.reshape(-1, x.shape[-1]).float().contiguous()
        if layer.kernel is not None:
            # The GEMV (codes read once per 8 rows) up to the kernels' int8_gemv_max_rows, then
            # the GEMM by widened panels (codes read and widened once for all rows).
            gemm = x2.shape[0] > layer.kernel.int8_gemv_max_rows
            y = (layer.kernel.int8_gemm if gemm else layer.kernel.int8_gemv)(x2, layer.codes,
                                                                              layer.scale)
        else:
            y = x2 @ self.dequantize(layer)
        if y.shape[1] != layer.out_features:
            y = y[:, :layer.out_features]
        if layer.bias is not None:
            y = y + layer.bias
        return y if plain else y.to(x.dtype).reshape(*x.shape[:-1], -1)

    @staticmethod
    def dequantize(layer: Linear) -> torch.Tensor:
        """W^T [K, N_padded] in float32."""
        if layer.kernel is not None:
            return layer.kernel.int8_dequantize(layer.codes, layer.scale)
        tiles, k, _ = layer.codes.shape
        w = layer.codes.transpose(1, 2).reshape(tiles * TILE, k).float() * layer.scale[:, None]
        return w.t()


def _cpu_kernel() -> Any:
    """The compiled kernel, or None (with a warning) where nothing can build it."""
    from pkv.csrc import cpp_build

    return cpp_build.kernels_or_none()
