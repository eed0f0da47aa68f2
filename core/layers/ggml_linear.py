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
from torch import nn

from pkv.core.layers.ggml_tensor import GGMLTensor, drop_pages
from pkv.core.layers.int4_tiles import gemv_rows, k4_tiled, tiled
from pkv.core.layers.linear import FusedOperands, Linear, LinearMethod, ParamLayout, as_tensor
from pkv.csrc import cpp_build

# FusedOperands.group_size that tells the C++ decoder its operands are ggml parts.
GGML_GROUP = -1
# Types whose blocks are groups of 32 inputs of 4-bit codes under a scale and an offset.
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT4_GROUP = 32


class GGMLLinearMethod(LinearMethod):
    """Weights as ggml blocks, one GGMLTensor per fused part."""

    name = "gguf"

    def __init__(self) -> None:
        # x's bits in the 4-bit tiles' GEMV (32 float, 16 or 8) and the K-quants' (32 or 8)
        self.activation_bits = 32

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

    def set_activations(self, activations: str) -> None:
        """float32; int16 rows for the 4-bit tiles' integer GEMV (AWQ's kernels); int8 rows
        for the blocks' kernels, the 4-bit types then kept as blocks too: the K-quants and the
        32-value types (csrc/ggml_q8_cpu.cpp and ggml_groups_cpu.cpp at few rows,
        csrc/ggml_tiles_cpu.cpp at more)."""
        bits = {"float32": 32, "int16": 16, "int8": 8}[activations]
        kernel = cpp_build.kernels_or_none()
        if bits != 32 and kernel is None:
            raise ValueError(f"awq_activations={activations} needs the CPU kernels, which did "
                             "not build here")
        if bits != 32 and not kernel.awq_gemv_has_integer():
            raise ValueError(f"awq_activations={activations} needs the avx2 or avx512 CPU "
                             f"kernels; this model runs the {kernel.isa} kernels")
        self.activation_bits = bits

    def process_weights_after_loading(self, layer: Linear) -> None:
        parts: list[GGMLTensor] = layer.parts
        layer.kernel = cpp_build.kernels_or_none()
        if layer.kernel is None:  # no compiler: torch's GEMM on a float copy
            layer.weight_f32 = torch.cat([p.dequantize() for p in parts])
        elif (all(p.format.name in INT4_TYPES for p in parts)
              and not self._int8_blocks(layer.kernel, parts)):
            _to_int4_tiles(layer)
            return
        for i, part in enumerate(parts):  # counted as the model's weights (weight_bytes)
            layer.register_buffer(f"blocks_{i}", part.data, persistent=False)
        layer.blocks = [p.data for p in parts]  # the kernel's operands, listed once
        layer.qtypes = torch.tensor([p.qtype for p in parts], dtype=torch.int64)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.kernel is None:
            return F.linear(x.float(), layer.weight_f32, layer.bias).to(x.dtype)
        flat = x.reshape(-1, x.shape[-1]).float().contiguous()
        if layer.parts is None:  # 4-bit tiles
            y = layer.kernel.awq_linear(flat, layer.codes, layer.scales, layer.zs,
                                        layer.bias, layer.out_features, INT4_GROUP,
                                        gemv_rows(layer.kernel, self.activation_bits),
                                        self.activation_bits)
        else:
            y = layer.kernel.ggml_linear(flat, layer.blocks, layer.qtypes, layer.bias, None,
                                         self.block_bits)
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    def fused_operands(self, layer: Linear) -> FusedOperands | None:
        if layer.kernel is None:
            return None
        if layer.parts is None:
            return FusedOperands([layer.codes, layer.scales, layer.zs], INT4_GROUP,
                                 self.activation_bits)
        return FusedOperands([*layer.blocks, layer.qtypes], GGML_GROUP, self.activation_bits)

    def _int8_blocks(self, kernel: Any, parts: list[GGMLTensor]) -> bool:
        """Whether int8 activations take these 4-bit parts as they are: the blocks' int8
        kernels read Q4_0 and Q4_K at 4.5 bits a weight, Q4_1 at 5, where the 4-bit tiles hold
        5-6 (Q4_K 4.75; at 8B: the whole model at the file's size, and decode 1.2x the tiles'
        when they held 6), and their int8 tiles at 16 and 64 sequences run ~1.5x the 4-bit
        kernel's int8 GEMV."""
        return self.block_bits == 8 and bool(kernel.ggml_int8_kquants)

    @property
    def block_bits(self) -> int:
        """x's bits in the block GEMV: int8 where asked, else float32 (int16 is the tiles')."""
        return 8 if self.activation_bits == 8 else 32


def _to_int4_tiles(layer: Linear) -> None:
    """4-bit parts repacked for the 4-bit kernel (csrc/awq_cpu.cpp): a batch-1 GEMV there runs
    several times as fast as the generic block GEMV (a Q4_K layer ~1.5x the blocks' float
    GEMV), for codes plus float32 scales and zs per 32 values (6 bits a weight against Q4_0's
    4.5, Q4_1's 5; Q4_0 alone, whose zs is 8 scales, 5), or Q4_K's own scale codes under
    float32 d and dmin per 256 (4.75 against its 4.5). The blocks' pages are handed back once
    converted."""
    names = {p.format.name for p in layer.parts}
    if names == {"Q4_K"}:
        tiles = k4_tiled(*_by_input([k4_form(p) for p in layer.parts]))
    else:
        codes, scales, zs = _by_input([int4_form(p) for p in layer.parts])
        tiles = tiled(codes, scales, None if names == {"Q4_0"} else zs)  # Q4_0: zs = 8 scales
    for name, tensor in zip(("codes", "scales", "zs"), tiles):
        layer.register_buffer(name, tensor, persistent=False)
    layer.int4_types = sorted(names)
    for part in layer.parts:
        drop_pages(part.data)
    layer.parts = None


def _by_input(forms: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    """The parts' forms ([rows, ...] tensors each), joined along the rows and transposed to
    [..., rows] as the tiles take them."""
    return [torch.cat(pieces).t().contiguous() for pieces in zip(*forms)]


def int4_form(t: GGMLTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-bit tensor (Q4_0, Q4_1, Q4_K) as codes [rows, cols] in 0..15 and per-32-value
    scales and zs [rows, cols / 32] with value = code * scale - zs, as ggml computes it
    (Q4_0: d(q - 8); Q4_1: dq + m; Q4_K: (d sc) q - dmin m per 32-value sub-block)."""
    fmt = t.format
    rows = t.shape[0]
    blocks = t.data.contiguous().reshape(rows, -1, fmt.bytes)
    d = _halves(blocks[..., 0:2])
    if fmt.name in ("Q4_0", "Q4_1"):
        qs = blocks[..., (2 if fmt.name == "Q4_0" else 4):]
        codes = torch.cat([qs & 0xF, qs >> 4], dim=-1)  # values j and j + 16 of each block
        zs = 8 * d if fmt.name == "Q4_0" else -_halves(blocks[..., 2:4])
        return codes.reshape(rows, -1), d, zs
    codes, sc, mn, d, dmin = k4_form(t)
    per_group = (rows, -1, 8)  # a super-block's d over its 8 groups
    return (codes, (d.unsqueeze(-1) * sc.float().reshape(per_group)).reshape(rows, -1),
            (dmin.unsqueeze(-1) * mn.float().reshape(per_group)).reshape(rows, -1))


def k4_form(t: GGMLTensor) -> tuple[torch.Tensor, ...]:
    """A Q4_K tensor as codes [rows, cols] in 0..15, its 6-bit scale and min codes
    [rows, cols / 32] (uint8) and float32 d and dmin [rows, cols / 256]: value =
    code * (d sc) - dmin m per 32-value sub-block."""
    rows = t.shape[0]
    blocks = t.data.contiguous().reshape(rows, -1, t.format.bytes)
    sc, mn = _k4_scales(blocks[..., 4:16])  # [rows, blocks, 8] sub-block scale / min codes
    qs = blocks[..., 16:].reshape(rows, -1, 4, 32)  # 64 values per 32 bytes: low, then high
    codes = torch.stack([qs & 0xF, qs >> 4], dim=3).reshape(rows, -1)
    return (codes, sc.reshape(rows, -1), mn.reshape(rows, -1), _halves(blocks[..., 0:2]),
            _halves(blocks[..., 2:4]))


def _halves(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian float16s as float32 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _k4_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's eight 6-bit scales and mins, packed in 12 bytes, as uint8 [..., 8] each."""
    q = packed.to(torch.int32)
    low = torch.cat([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], -1)
    mins = torch.cat([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
    return low.to(torch.uint8), mins.to(torch.uint8)


def use_ggml(layer: Linear, activation_bits: int = 32) -> None:
    """Make a float linear (an LM head, built before the checkpoint said its format) hold
    ggml blocks instead of a float weight, with activations of `activation_bits` (those of
    the model's other linears); its tensor loads after."""
    method = GGMLLinearMethod()
    method.activation_bits = activation_bits
    if hasattr(layer, "weight"):
        del layer.weight
    layer.method = method
    layer.layouts = {**method.create_weights(layer, torch.float32),
                     **({"bias": layer.layouts["bias"]} if "bias" in layer.layouts else {})}


def ggml_storage(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(storage label, tensor) of every weight a model holds in a GGUF's formats: the block
    type ("Q6_K"), or "Q4_K as 4-bit tiles" for parts repacked for the 4-bit kernel."""
    found: list[tuple[str, torch.Tensor]] = []
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.method, GGMLLinearMethod):
            if module.parts is not None:
                found += [(p.format.name, p.data) for p in module.parts]
            elif hasattr(module, "codes"):
                label = f"{'+'.join(module.int4_types)} as 4-bit tiles"
                found += [(label, getattr(module, n)) for n in ("codes", "scales", "zs")]
        table = getattr(module, "table", None)
        if isinstance(table, GGMLTensor):
            found.append((table.format.name, table.data))
        for tensor in getattr(module, "expert_blocks", {}).values():
            found.append((tensor.format.name, tensor.data))
    return found


def sixteen_bit_blocks(tensor: Any) -> Any:
    """A float16 / bfloat16 table (embedding, LM head) as ggml blocks, so that it stays at its
    own size beside the linears that do; other tensors as they are."""
    if isinstance(tensor, GGMLTensor):
        return tensor
    tensor = as_tensor(tensor)
    is_16_bit = tensor.dtype in (torch.float16, torch.bfloat16)
    if is_16_bit and tensor.dim() == 2 and tensor.shape[1] % 32 == 0:
        return GGMLTensor.from_float(tensor)
    return tensor
