"""The whole decoder stack of a float32 model on CPU in one C++ call per step.

csrc/decoder_cpu.cpp runs the same kernels as the Python model does once `use_kernels` gave
it them, in the same order, so its hidden states are bitwise the same; it only leaves out
the ~40 Python calls per layer between them (a SmolLM2 4-bit batch-1 step: 9.2 -> 6.2 ms).
It is built only where every piece it replaces is a kernel: linears that are 4-bit AWQ on the
CPU kernel or float32 packed by oneDNN, the `cpu` attention backend, the layer ops, one rank;
anything else runs the Python model.
"""

from __future__ import annotations

from typing import Any

import torch

from pkv.core.linear import Linear, UnquantizedLinearMethod
from pkv.core.models.base import CausalLM
from pkv.plugins import cpp_build
from pkv.plugins.weights.awq import GEMV_MAX_ROWS, AWQLinearMethod


def build_fused_decoder(model: CausalLM, ops: Any) -> Any | None:
    """The C++ decoder over `model`'s weights (shared, not copied), or None where it does not
    apply; `ops` are the layer ops (csrc/layer_ops_cpu.cpp), None where they did not build."""
    inner = model.model
    layers = list(inner.layers)
    if model.plan.tp.enabled or not layers or ops is None or fused_decoder_gaps(model):
        return None
    linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                layer.mlp.down_proj) for layer in layers]
    kernel_weights = [[_kernel_weights(linear) for linear in group] for group in linears]
    if any(weights is None for group in kernel_weights for weights in group):
        return None
    attn = layers[0].self_attn
    if attn.backend.name != "cpu":  # the C++ paged attention
        return None
    ext = cpp_build.build_or_none("decoder_cpu.cpp", "CPU decoder stack")
    if ext is None:
        return None
    rope = inner.rotary_emb
    assert rope is not None
    decoder = ext.CpuDecoder(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
                             inner.norm.eps, GEMV_MAX_ROWS, rope.cos, rope.sin,
                             inner.norm.weight)
    for layer, group, weights in zip(layers, linears, kernel_weights):
        decoder.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                          weights, [lin.bias for lin in group],
                          [lin.out_features for lin in group], [_group(lin) for lin in group])
    return decoder


def _kernel_weights(linear: Linear) -> list[torch.Tensor] | None:
    """What the C++ decoder multiplies with: AWQ (codes, scales, zs), or the oneDNN-packed
    float32 weight; None for anything else."""
    method = linear.method
    if isinstance(method, AWQLinearMethod):
        if method.kernel == "cpu" and getattr(linear, "kernel", None) is not None:
            return [linear.codes, linear.scales_f32, linear.zs]
        return None
    packed = linear._buffers.get("packed_weight")
    if isinstance(method, UnquantizedLinearMethod) and packed is not None:
        return [packed]
    return None


def _group(linear: Linear) -> int:
    return linear.method.group_size if isinstance(linear.method, AWQLinearMethod) else 0


def fused_decoder_gaps(model: CausalLM) -> list[str]:
    """Why csrc/decoder_cpu.cpp cannot compute `model`'s layers (empty: it can); these
    models take the Python layer loop, with the same kernels per op where they apply."""
    gaps = []
    if not model.fused_decoder_compatible:
        gaps.append(f"the {model.config.architecture} layer differs from Llama's")
    attn = model.model.layers[0].self_attn if len(model.model.layers) else None
    if any(w is not None for w in model.config.layer_windows):
        gaps.append("sliding-window layers")
    if attn is not None and (attn.rotary_emb is None or
                             attn.rotary_emb.spec.rotary_dim != attn.head_dim or
                             attn.rotary_emb.spec.long_threshold is not None):
        gaps.append("partial or LongRoPE rotary embeddings")
    return gaps
