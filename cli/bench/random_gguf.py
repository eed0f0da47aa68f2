"""A GGUF of a real model's shape with random weights, in llama.cpp's `Q4_K_M` mix, so that
a model of that size can be loaded and decoded here without downloading one.

Per tensor, the types `llama-quantize` picks for Q4_K_M: Q4_K everywhere but `attn_v` and
`ffn_down` on the layers it gives more bits (the first and last eighth, and every third one
between), the LM head (`output`) in Q6_K; a row whose length is not a whole number of K-quant
blocks (256) takes llama-quantize's fallback (Q4_K -> Q5_0, Q6_K -> Q8_0), which is why a
small model's file is mostly Q5_0; norms and biases in F32. Blocks are random bytes under small
positive scales (finite values of about the size of trained weights). The tokenizer is the
bundled SmolLM2's, padded with `<extra_N>` tokens to the shape's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float
    context: int
    arch: str = "llama"
    qkv_bias: bool = False
    norm_eps: float = 1e-5


SHAPES = {
    "llama-3.1-8b": Shape(32, 4096, 14336, 32, 8, 128256, 500000.0, 131072),
    "llama-3.2-1b": Shape(16, 2048, 8192, 32, 8, 128256, 500000.0, 131072),
    "qwen2.5-0.5b": Shape(24, 896, 4864, 14, 2, 151936, 1000000.0, 32768, arch="qwen2",
                          qkv_bias=True, norm_eps=1e-6),
}
# Where a block keeps its float16 scale(s), in bytes from the block's start.
_SCALES = {"Q4_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q8_0": (0,)}
# llama-quantize's type for a row that is not a whole number of 256-value K-quant blocks.
_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}


def _more_bits(layer: int, layers: int) -> bool:
    """The layers llama-quantize's Q4_K_M gives Q6_K attn_v / ffn_down."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * eighth or (layer - eighth) % 3 == 2


Plan = list[tuple[str, tuple[int, ...], str]]


def tensor_plan(shape: Shape) -> Plan:
    """(GGUF name, PyTorch shape, type) of every tensor."""
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    plan: Plan = [("token_embd.weight", (shape.vocab, shape.hidden), "Q4_K")]
    for i in range(shape.layers):
        wide = "Q6_K" if _more_bits(i, shape.layers) else "Q4_K"
        plan += [(f"blk.{i}.attn_norm.weight", (shape.hidden,), "F32"),
                 (f"blk.{i}.attn_q.weight", (shape.hidden, shape.hidden), "Q4_K"),
                 (f"blk.{i}.attn_k.weight", (kv, shape.hidden), "Q4_K"),
                 (f"blk.{i}.attn_v.weight", (kv, shape.hidden), wide)]
        if shape.qkv_bias:
            plan += [(f"blk.{i}.attn_{x}.bias", (n,), "F32")
                     for x, n in (("q", shape.hidden), ("k", kv), ("v", kv))]
        plan += [(f"blk.{i}.attn_output.weight", (shape.hidden, shape.hidden), "Q4_K"),
                 (f"blk.{i}.ffn_norm.weight", (shape.hidden,), "F32"),
                 (f"blk.{i}.ffn_gate.weight", (shape.intermediate, shape.hidden), "Q4_K"),
                 (f"blk.{i}.ffn_up.weight", (shape.intermediate, shape.hidden), "Q4_K"),
                 (f"blk.{i}.ffn_down.weight", (shape.hidden, shape.intermediate), wide)]
    plan += [("output_norm.weight", (shape.hidden,), "F32"),
             ("output.weight", (shape.vocab, shape.hidden), "Q6_K")]
    return [(name, dims, _fitted(kind, dims[-1])) for name, dims, kind in plan]


def _fitted(kind: str, row: int) -> str:
    return kind if kind == "F32" or row % 256 == 0 else _FALLBACK[kind]


def _random_tensor(rng: np.random.Generator, name: str, dims: tuple[int, ...],
                   kind: str) -> np.ndarray:
    if kind == "F32":  # norms' weights one, biases zero
        fill = np.zeros if name.endswith(".bias") else np.ones
        return fill(dims, dtype=np.float32)
    import gguf

    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    rows, blocks_per_row = dims[0], dims[1] // block
    blocks = rng.integers(0, 256, (rows, blocks_per_row, block_bytes), dtype=np.uint8)
    for offset in _SCALES[kind]:
        scale = (rng.random((rows, blocks_per_row)) * 2e-4 + 1e-4).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(rows, blocks_per_row, 2)
    return blocks.reshape(rows, -1)


def write_random_gguf(out: Path, shape: str | Shape, seed: int = 0) -> int:
    """Write the GGUF of a shape (one of SHAPES by name, or any Shape); returns its size in
    bytes."""
    import gguf

    from pkv.core.model_loader.loader import bundled_model_path
    from pkv.core.progress import progress_bar
    from pkv.plugins.weights.gguf_header import read_header

    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
        label, shape = shape, SHAPES[shape]
    else:
        label = f"{shape.arch} {shape.layers} x {shape.hidden}"
    writer = gguf.GGUFWriter(str(out), shape.arch)
    _write_metadata(writer, shape, label)
    _copy_tokenizer(writer, read_header(bundled_model_path()).fields, shape.vocab)
    plan = tensor_plan(shape)
    for name, dims, kind in plan:
        qtype = gguf.GGMLQuantizationType[kind]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims)) // block * size
        byte_shape = dims if kind == "F32" else (dims[0], dims[-1] // block * size)
        writer.add_tensor_info(name, byte_shape, np.dtype(np.float32 if kind == "F32" else
                                                          np.uint8), nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, kind in progress_bar(plan, len(plan), f"writing {out.name}"):
        writer.write_tensor_data(_random_tensor(rng, name, dims, kind))
    writer.close()
    return out.stat().st_size


def _write_metadata(writer: object, shape: Shape, name: str) -> None:
    writer.add_name(f"random {name} (Q4_K_M mix)")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.norm_eps)


def _copy_tokenizer(writer: object, fields: dict[str, Any], vocab: int) -> None:
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    extra = vocab - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens + [f"<extra_{i}>" for i in range(extra)])
    writer.add_token_types(types + [4] * extra)  # user-defined: matched whole, never merged
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    for key in ("bos_token_id", "eos_token_id"):
        value = fields.get(f"tokenizer.ggml.{key}")
        if value is not None:
            getattr(writer, f"add_{key.removesuffix('_token_id')}_token_id")(value)
