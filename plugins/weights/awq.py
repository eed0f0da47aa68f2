"""The `awq` weight loader: AutoAWQ "GEMM" checkpoints (4-bit, grouped, with zero points).

Checkpoint layout per linear layer (in K, out N, group G), transposed from nn.Linear:
`qweight` int32 [K, N/8] and `qzeros` int32 [K/G, N/8], eight 4-bit codes per int32 packed
along the outputs in AutoAWQ's interleaved order, and `scales` [K/G, N]:
W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n].

On CPU the codes are repacked once after loading for the fused C++ kernel (csrc/awq_cpu.cpp),
or dequantized once for torch's GEMM where no compiler can build it; on CUDA the checkpoint
layout feeds the Triton kernel as is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pkv.core.layers.int4_tiles import PACK, gemv_rows, tiled
from pkv.core.layers.linear import FusedOperands, Linear, LinearMethod, ParamLayout
from pkv.core.model_loader.loader import ModelSource
from pkv.core.model_loader.quantization import WeightLoader

# Nibble i of a packed int32 holds output column 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
ACTIVATION_BITS = {"float32": 32, "int16": 16, "int8": 8}  # awq_activations -> the kernel's


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[R, N] integer codes in 0..15 -> [R, N/8] int32 in AutoAWQ's order."""
    rows, cols = codes.shape
    grouped = codes.to(torch.int64).reshape(rows, cols // PACK, PACK)[..., list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    packed = (grouped << shifts).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[R, N/8] int32 -> [R, N] uint8 codes (inverse of `pack_int4`)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return nibbles[..., list(AWQ_REVERSE_ORDER)].reshape(packed.shape[0], -1).to(torch.uint8)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int) -> torch.Tensor:
    """The float weight [K, N] of a checkpoint's (qweight, qzeros, scales)."""
    q = unpack_int4(qweight).float()
    z = unpack_int4(qzeros).float().repeat_interleave(group_size, dim=0)
    return (q - z) * scales.float().repeat_interleave(group_size, dim=0)


def parse_group_size(quant_config: dict[str, Any]) -> int:
    """The group size of an AWQ quantization_config, checked; errors name the field."""
    bits = quant_config.get("bits", quant_config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"AWQ checkpoints with bits={bits} are not supported (only 4)")
    version = str(quant_config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported (only 'gemm')")
    group = quant_config.get("group_size", quant_config.get("q_group_size"))
    if not isinstance(group, int) or group <= 0 or group % 2:
        raise ValueError(f"AWQ group_size must be a positive even integer, got {group!r}")
    return group


class AWQLinearMethod(LinearMethod):
    """4-bit weights, dequantized on the fly by a fused kernel: `cpu` (csrc, repacked
    codes) or `triton` (the checkpoint layout; GPUs, or CPU under TRITON_INTERPRET=1); or
    `torch`: dequantized once after loading, for torch's GEMM (what `cpu` falls back to)."""

    name = "awq"

    def __init__(self, group_size: int, kernel: str = "cpu") -> None:
        self.group_size = group_size
        self.kernel = kernel
        self.activation_bits = 32  # of the GEMV's rows: 32 float, 16 or 8 quantized

    def set_activations(self, activations: str) -> None:
        """float32, or int16 / int8: rows quantized (per group / per 32 inputs) for the
        integer-dot GEMVs (up to the kernels' `awq_gemv_max_rows` rows, int8 up to
        `awq_int8_max_rows`; the many-row GEMM stays float32), on the avx2/avx512 kernels."""
        if activations != "float32":
            _check_integer_kernel(activations, self.kernel, self.group_size)
        self.activation_bits = ACTIVATION_BITS[activations]

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> dict[str, ParamLayout]:
        k, n, g = layer.in_features, layer.out_features, self.group_size
        if k % g:
            raise ValueError(f"AWQ group size {g} does not divide a layer's input size {k}")
        if any(size % PACK for size in layer.out_sizes):
            raise ValueError(f"AWQ needs output sizes divisible by {PACK}, got {layer.out_sizes}")
        layer.qweight = _frozen(torch.empty(k, n // PACK, dtype=torch.int32))
        layer.qzeros = _frozen(torch.empty(k // g, n // PACK, dtype=torch.int32))
        layer.scales = _frozen(torch.empty(k // g, n, dtype=dtype))
        return {"qweight": ParamLayout(output_dim=1, pack=PACK, input_dim=0),
                "qzeros": ParamLayout(output_dim=1, pack=PACK, input_dim=0, input_pack=g),
                "scales": ParamLayout(output_dim=1, input_dim=0, input_pack=g)}

    def process_weights_after_loading(self, layer: Linear) -> None:
        if not torch.isfinite(layer.scales).all():
            raise ValueError("AWQ scales hold non-finite values")
        if self.kernel == "triton":
            return  # the Triton kernel reads the checkpoint layout
        use_kernel = self.kernel == "cpu" and self.group_size % 8 == 0
        layer.kernel = _cpu_kernel() if use_kernel else None
        if layer.kernel is None:  # no compiler, an odd group size, or asked: torch's GEMM
            layer.weight_t = _frozen(dequantize(layer.qweight, layer.qzeros, layer.scales,
                                                self.group_size))
        else:
            scales = layer.scales.float()
            zeros = unpack_int4(layer.qzeros).float()
            codes, scales_f32, zs = tiled(unpack_int4(layer.qweight), scales, zeros * scales)
            layer.codes, layer.scales_f32, layer.zs = _frozen(codes), _frozen(scales_f32), _frozen(zs)
        del layer.qweight, layer.qzeros, layer.scales

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "triton":
            from pkv.plugins.weights.awq_triton import awq_gemm_triton

            y = awq_gemm_triton(x.reshape(-1, x.shape[-1]), layer.qweight, layer.qzeros,
                                layer.scales, self.group_size).reshape(*x.shape[:-1], -1)
            return y if layer.bias is None else y + layer.bias
        if layer.kernel is not None:
            return layer.kernel.awq_linear(x, layer.codes, layer.scales_f32, layer.zs, layer.bias,
                                           layer.out_features, self.group_size,
                                           gemv_rows(layer.kernel, self.activation_bits),
                                           self.activation_bits)
        y = x.float() @ layer.weight_t
        if layer.bias is not None:
            y = y + layer.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    def fused_operands(self, layer: Linear) -> FusedOperands | None:
        if self.kernel != "cpu" or layer.kernel is None:
            return None  # Triton, or torch's GEMM over a dequantized weight
        return FusedOperands([layer.codes, layer.scales_f32, layer.zs], self.group_size,
                             self.activation_bits)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _check_integer_kernel(activations: str, kernel: str, group: int) -> None:
    ext = _cpu_kernel() if kernel == "cpu" else None
    if ext is None or not ext.awq_gemv_has_integer():
        if kernel != "cpu":
            runs = f"the {kernel} kernel"
        elif ext is None:
            runs = "torch (the CPU kernels did not build)"
        else:
            runs = f"the {ext.isa} kernels"
        raise ValueError(f"awq_activations={activations} needs the avx2 or avx512 CPU kernels; "
                         f"this model runs {runs}")
    if activations == "int16" and (group % 8 or group > ext.awq_int16_max_group):
        # its int32 sums of a group must not overflow
        raise ValueError(f"awq_activations=int16 takes AWQ groups of a multiple of 8 inputs up "
                         f"to {ext.awq_int16_max_group}; this checkpoint's are {group}")
    if activations == "int8" and group % ext.awq_int8_block:  # a group holds whole blocks
        raise ValueError(f"awq_activations=int8 takes AWQ groups of a multiple of "
                         f"{ext.awq_int8_block} inputs; this checkpoint's are {group}")


def _cpu_kernel() -> Any:
    """The compiled kernel, or None (with a warning) where nothing can build it."""
    from pkv.csrc import cpp_build

    return cpp_build.kernels_or_none()


class AWQLoader(WeightLoader):
    """Loads AutoAWQ GEMM checkpoints (pkv's own `pkv quantize --awq` output and others)."""

    name = "awq"

    def linear_method(self, source: ModelSource, device: torch.device) -> LinearMethod:
        quant_config = source.hf_config.get("quantization_config") or {}
        group = parse_group_size(quant_config)
        skipped = quant_config.get("modules_to_not_convert") or []
        if any(name not in ("lm_head",) for name in skipped):
            raise ValueError(f"AWQ checkpoints with modules_to_not_convert={skipped} are not "
                             "supported")
        return AWQLinearMethod(group, "triton" if device.type == "cuda" else "cpu")
