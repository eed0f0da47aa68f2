"""The whole decoder stack of a 4-bit AWQ model on CPU in one C++ call per step.

csrc/decoder_cpu.cpp runs the same kernels as the Python model does once `use_kernels` gave
it them, in the same order, so its hidden states are bitwise the same; it only leaves out
the ~40 Python calls per layer between them (a SmolLM2 batch-1 step: 9.2 -> 6.2 ms).
It is built only where every piece it replaces is a kernel: AWQ linears on the CPU kernel,
the `cpu` attention backend, the layer ops, one rank; anything else runs the Python model.
"""

from __future__ import annotations

from typing import Any

from pkv.core.models.llama import LlamaForCausalLM
from pkv.plugins import cpp_build
from pkv.plugins.weights.awq import GEMV_MAX_ROWS, AWQLinearMethod


def build_fused_decoder(model: LlamaForCausalLM, ops: Any) -> Any | None:
    """The C++ decoder over `model`'s weights (shared, not copied), or None where it does not
    apply; `ops` are the layer ops (csrc/layer_ops_cpu.cpp), None where they did not build."""
    inner = model.model
    layers = list(inner.layers)
    if model.plan.tp.enabled or not layers or ops is None:
        return None
    linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                layer.mlp.down_proj) for layer in layers]
    if not all(_on_awq_kernel(linear) for group in linears for linear in group):
        return None
    attn = layers[0].self_attn
    if attn.backend.name != "cpu" or getattr(attn.backend, "kernel", None) is None:
        return None
    ext = cpp_build.build_or_none("decoder_cpu.cpp", "CPU AWQ decoder")
    if ext is None:
        return None
    rope = inner.rotary_emb
    decoder = ext.AwqDecoder(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                             inner.norm.eps, linears[0][0].method.group_size, GEMV_MAX_ROWS,
                             rope.cos, rope.sin, inner.norm.weight)
    for layer, group in zip(layers, linears):
        decoder.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                          [t for lin in group for t in (lin.codes, lin.scales_f32, lin.zs)],
                          [lin.bias for lin in group], [lin.out_features for lin in group])
    return decoder


def _on_awq_kernel(linear: Any) -> bool:
    return (isinstance(linear.method, AWQLinearMethod) and linear.method.kernel == "cpu"
            and getattr(linear, "kernel", None) is not None)
