"""The `fp8` weight loader: float8_e4m3fn weights with per-channel or per-tensor scales.

Reads the layout vLLM and compressed-tensors checkpoints use: `weight` [N, K] in
float8_e4m3fn and `weight_scale` ([N, 1] per channel, or one value per tensor), with
W = weight * weight_scale. A float checkpoint loaded with `--quantization fp8` is quantized
per channel while loading. On CPU the weights are dequantized to the compute dtype once; on
CUDA GPUs with FP8 (compute capability 8.9+) `torch._scaled_mm` multiplies them directly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pkv.core.layers.linear import Linear, LinearMethod, ParamLayout, as_tensor, check_shape
from pkv.core.model_loader.loader import ModelSource
from pkv.core.model_loader.quantization import WeightLoader

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (float8 [N, K], float32 scales [N, 1]) with W ~= q * scale."""
    absmax = weight.float().abs().amax(dim=1, keepdim=True)
    scale = (absmax / FP8_MAX).clamp(min=1e-12)
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (float8 [N, K], a float32 scale of shape [1])."""
    scale = (weight.float().abs().amax() / FP8_MAX).clamp(min=1e-12).reshape(1)
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def check_scale(scale: torch.Tensor, name: str) -> None:
    if not torch.isfinite(scale).all() or not (scale > 0).all():
        raise ValueError(f"checkpoint tensor {name!r} holds non-finite or non-positive FP8 "
                         "scales")


class FP8LinearMethod(LinearMethod):
    """FP8 weights; `scaled_mm` multiplies in FP8, otherwise they are dequantized once."""

    name = "fp8"
    ignored = frozenset({"input_scale"})  # activations are scaled dynamically per token

    def __init__(self, scaled_mm: bool, quantize_on_load: bool = False) -> None:
        self.scaled_mm = scaled_mm
        self.quantize_on_load = quantize_on_load

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> dict[str, ParamLayout]:
        self.dtype = dtype
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features,
                                                dtype=FP8), requires_grad=False)
        # float32 whatever the default dtype (the model is built under the compute dtype):
        # _scaled_mm takes no other scales
        layer.weight_scale = nn.Parameter(torch.empty(layer.out_features, 1,
                                                      dtype=torch.float32),
                                          requires_grad=False)
        layouts = {"weight": ParamLayout(output_dim=0, input_dim=1)}
        if not self.quantize_on_load:
            layouts["weight_scale"] = ParamLayout(output_dim=0)
        return layouts

    def load(self, layer: Linear, name: str, tensor: torch.Tensor, shard: int | None,
             full_name: str) -> None:
        rows = layer.shard_rows(shard)
        if name == "weight_scale":
            check_scale(tensor, full_name)
            if tensor.numel() == 1:  # per tensor: every row of the shard shares it
                tensor = tensor.reshape(1, 1).expand(rows.stop - rows.start, 1)
            check_shape(layer.weight_scale[rows], tensor, full_name)
            layer.weight_scale[rows] = tensor
        elif name == "weight" and self.quantize_on_load and tensor.dtype != FP8:
            weight, scale = quantize_per_channel(tensor)
            check_shape(layer.weight[rows], weight, full_name)
            layer.weight[rows], layer.weight_scale[rows] = weight, scale
        else:
            if name == "weight" and tensor.dtype != FP8:
                raise ValueError(f"checkpoint tensor {full_name!r} is {tensor.dtype}, not "
                                 "float8_e4m3fn")
            super().load(layer, name, tensor, shard, full_name)

    def rank_part(self, layer: Linear, name: str, tensor: Any, shard: int | None) -> torch.Tensor:
        if name == "weight_scale" and tuple(_shape(tensor)) in ((), (1,)):
            return as_tensor(tensor)  # a per-tensor scale serves every rank's rows
        return super().rank_part(layer, name, tensor, shard)

    def process_weights_after_loading(self, layer: Linear) -> None:
        # _scaled_mm with row-wise scales takes bfloat16 out (other dtypes only on some torch
        # versions) and sizes in multiples of 16 (an uneven tensor-parallel split is not):
        # any other layer is dequantized once.
        out_features, in_features = layer.weight.shape
        layer.fp8_matmul = (self.scaled_mm and self.dtype == torch.bfloat16
                            and in_features % 16 == 0 and out_features % 16 == 0)
        if not layer.fp8_matmul:
            dense = layer.weight.float() * layer.weight_scale
            layer.weight = nn.Parameter(dense.to(self.dtype), requires_grad=False)
            del layer.weight_scale

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if not layer.fp8_matmul:
            return F.linear(x, layer.weight, layer.bias)
        x2 = x.reshape(-1, x.shape[-1])
        x8, x_scale = quantize_per_channel(x2)  # dynamic, per token
        y = torch._scaled_mm(x8, layer.weight.t(), scale_a=x_scale,
                             scale_b=layer.weight_scale.t(), out_dtype=x.dtype)
        y = y.reshape(*x.shape[:-1], -1)
        return y if layer.bias is None else y + layer.bias


def _shape(tensor: Any) -> tuple[int, ...]:
    return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor.get_shape())


def supports_scaled_mm(device: torch.device) -> bool:
    """FP8 matmuls run natively on CUDA GPUs of compute capability 8.9 (Ada, Hopper) and up;
    not on ROCm, whose FP8 is another format (e4m3fnuz)."""
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= (8, 9))


def _check_config(quant_config: dict) -> None:
    method = quant_config.get("quant_method")
    if quant_config.get("weight_block_size"):  # DeepSeek-V3's, Qwen3-FP8's: weight_scale_inv
        raise ValueError(f"block-scaled FP8 (weight_block_size "
                         f"{quant_config['weight_block_size']}) is not supported; pkv reads "
                         "per-tensor and per-channel FP8 scales")
    if method == "compressed-tensors":
        for group in (quant_config.get("config_groups") or {}).values():
            weights = group.get("weights") or {}
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise ValueError(f"compressed-tensors weights {weights} are not FP8; pkv reads "
                                 "only float 8-bit weights")
            if weights.get("strategy") not in ("tensor", "channel"):
                raise ValueError(f"FP8 strategy {weights.get('strategy')!r} is not supported "
                                 "(tensor or channel)")


class FP8Loader(WeightLoader):
    """Loads FP8 checkpoints, or quantizes a float checkpoint to FP8 while loading."""

    name = "fp8"
    quantizes_float_checkpoints = True

    def linear_method(self, source: ModelSource, device: torch.device) -> LinearMethod:
        quant_config = source.hf_config.get("quantization_config")
        if quant_config:
            _check_config(quant_config)
        return FP8LinearMethod(supports_scaled_mm(device), quantize_on_load=not quant_config)
