"""Linear layers on weights in ggml's block formats (a GGUF's Q4_K, Q5_0, Q8_0, F16, ...),
kept at the file's size and multiplied by csrc/ggml_cpu.cpp.

Each fused part (q, k, v; gate, up) keeps its own tensor: a GGUF may store them in different
types (a `Q4_K_M` file often has `attn_v` in Q6_K beside a Q4_K `attn_q`), and keeping them
apart costs nothing, as the kernel walks the parts' rows as one output. A part that arrives
as float (an F32 tensor) is held as ggml's F32. Where the CPU kernels cannot build, the
weights are dequantized once for torch's GEMM.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pkv.core.layers.ggml_tensor import GGMLTensor
from pkv.core.layers.linear import FusedOperands, Linear, LinearMethod, ParamLayout, as_tensor

# FusedOperands.group_size that tells the C++ decoder its operands are ggml parts.
GGML_GROUP = -1


class GGMLLinearMethod(LinearMethod):
    """Weights as ggml blocks, one GGMLTensor per fused part."""

    name = "gguf"

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> dict[str, ParamLayout]:
        layer.parts = [None] * len(layer.out_sizes)
        return {"weight": ParamLayout(output_dim=0, input_dim=1)}

    def rank_part(self, layer: Linear, name: str, tensor: Any, shard: int | None) -> Any:
        if layer.split is None or name != "weight":
            return tensor if isinstance(tensor, GGMLTensor) else as_tensor(tensor)
        return super().rank_part(layer, name, tensor, shard)

    def load(self, layer: Linear, name: str, tensor: Any, shard: int | None,
             full_name: str) -> None:
        if name != "weight":
            super().load(layer, name, tensor, shard, full_name)
            return
        if not isinstance(tensor, GGMLTensor):
            tensor = GGMLTensor.from_float(as_tensor(tensor))
        rows = layer.shard_rows(shard)
        wanted = (rows.stop - rows.start, layer.in_features)
        if tensor.shape != wanted:
            raise ValueError(f"checkpoint tensor {full_name!r} has shape {tensor.shape}, "
                             f"the model expects {wanted}")
        layer.parts[shard or 0] = tensor

    def process_weights_after_loading(self, layer: Linear) -> None:
        from pkv.csrc import cpp_build

        parts: list[GGMLTensor] = layer.parts
        for i, part in enumerate(parts):  # counted as the model's weights (weight_bytes)
            layer.register_buffer(f"blocks_{i}", part.data, persistent=False)
        layer.qtypes = torch.tensor([p.qtype for p in parts], dtype=torch.int64)
        layer.kernel = cpp_build.kernels_or_none()
        if layer.kernel is None:  # no compiler: torch's GEMM on a float copy
            layer.weight_f32 = torch.cat([p.dequantize() for p in parts])

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.kernel is None:
            return F.linear(x.float(), layer.weight_f32, layer.bias).to(x.dtype)
        flat = x.reshape(-1, x.shape[-1]).float().contiguous()
        y = layer.kernel.ggml_linear(flat, [p.data for p in layer.parts], layer.qtypes,
                                     layer.bias)
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    def fused_operands(self, layer: Linear) -> FusedOperands | None:
        if layer.kernel is None:
            return None
        return FusedOperands([*(p.data for p in layer.parts), layer.qtypes], GGML_GROUP)


def use_ggml(layer: Linear) -> None:
    """Make a float linear (an LM head, built before the checkpoint said its format) hold
    ggml blocks instead of a float weight; its tensor loads after."""
    method = GGMLLinearMethod()
    if hasattr(layer, "weight"):
        del layer.weight
    layer.method = method
    layer.layouts = {**method.create_weights(layer, torch.float32),
                     **({"bias": layer.layouts["bias"]} if "bias" in layer.layouts else {})}
