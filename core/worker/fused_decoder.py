"""The whole decoder stack of a float32 model on CPU in one C++ call per step.

csrc/decoder_cpu.cpp runs the same kernels as the Python model does once `use_kernels` gave
it them, in the same order; it only leaves out the ~40 Python calls per layer between them
(a SmolLM2 4-bit batch-1 step: 9.2 -> 6.2 ms). It is built only where every piece it
replaces is a kernel: linears that are 4-bit AWQ or float32 on the CPU kernels, the `cpu`
attention backend, the layer ops, one rank, and layers it can express (Llama's, with the
options of the dense families: q/k norms, per-layer RoPE tables or none, windows,
soft-capping, post-sub-layer norms, multipliers, GeGLU). Anything else runs the Python model;
`fused_decoder_gaps` says why.
"""

from __future__ import annotations

from typing import Any

import torch

from pkv.core.layers.attention import Attention
from pkv.core.layers.mlp import GatedMLP
from pkv.core.layers.norm import RMSNorm
from pkv.core.models.base import CausalLM
from pkv.csrc import cpp_build

_NORM_SLOTS = ("in", "attn_out", "mlp_in", "mlp_out")


def fused_decoder_gaps(model: CausalLM) -> list[str]:
    """Why csrc/decoder_cpu.cpp cannot compute `model`'s layers (empty: it can); such
    models take the Python layer loop, with the same kernels per op where they apply."""
    gaps = []
    layers = list(model.model.layers)
    if model.plan.tp.enabled:
        gaps.append("tensor parallelism")
    for layer in layers:
        if not hasattr(layer, "fused_norms"):
            gaps.append(f"{type(layer).__name__} has no fused form")
            break
        if not isinstance(layer.mlp, GatedMLP) or layer.mlp.act not in ("silu", "swish",
                                                                         "gelu_pytorch_tanh",
                                                                         "gelu_tanh"):
            gaps.append(f"the MLP is {type(layer.mlp).__name__} ({getattr(layer.mlp, 'act', '')})")
            break
        rope = layer.self_attn.rotary_emb
        if rope is not None and rope.spec.long_threshold is not None:
            gaps.append("LongRoPE (two tables chosen per sequence)")
            break
    if layers and layers[0].self_attn.backend.name != "cpu":
        gaps.append(f"the {layers[0].self_attn.backend.name} attention backend")
    return gaps


def build_fused_decoder(model: CausalLM, ops: Any) -> Any | None:
    """The C++ decoder over `model`'s weights (shared, not copied), or None where it does not
    apply; `ops` are the layer ops (csrc/layer_ops_cpu.cpp), None where they did not build."""
    inner = model.model
    layers = list(inner.layers)
    if not layers or ops is None or fused_decoder_gaps(model):
        return None
    linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                layer.mlp.down_proj) for layer in layers]
    operands = [[lin.method.fused_operands(lin) for lin in group] for group in linears]
    if any(op is None for group in operands for op in group):
        return None
    ext = cpp_build.kernels_or_none()
    if ext is None:
        return None
    attn: Attention = layers[0].self_attn
    bits = min(op.activation_bits for group in operands for op in group)
    # (a pipeline stage but the last has no final norm: the layers' eps is the config's)
    eps = inner.norm.eps if inner.norm is not None else model.config.rms_norm_eps
    decoder = ext.CpuDecoder(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
                             eps, ext.awq_gemv_max_rows, bits, _weight(inner.norm))
    for layer, group, ops_of_group in zip(layers, linears, operands):
        norms, multiplier = layer.fused_norms()
        a: Attention = layer.self_attn
        q_norm = getattr(a, "q_norm", None)
        k_norm = getattr(a, "k_norm", None)
        rope = a.rotary_emb
        decoder.add_layer([_weight(norms.get(slot)) for slot in _NORM_SLOTS]
                          + [_weight(q_norm), _weight(k_norm)],
                          a.qk_norm == "full", rope.cos if rope else None,
                          rope.sin if rope else None, a.sliding_window or 0,
                          a.logits_soft_cap or 0.0, multiplier, layer.mlp.act.startswith("gelu"),
                          [op.tensors for op in ops_of_group], [lin.bias for lin in group],
                          [lin.out_features for lin in group],
                          [op.group_size for op in ops_of_group])
    for i, group in enumerate(linears):
        if all(lin.lora is not None for lin in group):  # adapters served (LoRA on)
            decoder.set_lora(i, [t for lin in group for t in (lin.lora.a, lin.lora.b)],
                             [lin.out_sizes for lin in group], group[0].lora.max_rank)
    return decoder


def _weight(norm: RMSNorm | None) -> torch.Tensor | None:
    """What a norm multiplies by, as the kernels take it (Gemma's 1 + weight, computed once)."""
    return None if norm is None else norm.scale().contiguous()
