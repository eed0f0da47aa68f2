"""Phi-3 and Phi-4-mini: Llama layers with three differences.

- The checkpoint fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; they are split
  into the usual part names on load, so tensor-parallel slicing and quantized layouts apply.
- RoPE may be LongRoPE (`longrope`, formerly `su`: short and long factors, see
  core/layers/rotary.py) and partial (`partial_rotary_factor`, 0.75 in Phi-4-mini).
- `sliding_window`, when set, windows every layer (as Mistral).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pkv.core.layers.linear import Linear, ParamLayout
from pkv.core.models.base import split_fused
from pkv.core.models.config import ModelConfig
from pkv.core.models.llama import LlamaForCausalLM

# transformers' Phi3Config defaults for fields a config.json may leave out
_ORIGINAL_MAX_POSITIONS = 4096
_RMS_NORM_EPS = 1e-5


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama with fused checkpoint projections, LongRoPE / partial RoPE and a window. Once
    loaded its layers are Llama's, so csrc/decoder_cpu.cpp computes them too, except with
    LongRoPE (see fused_decoder_gaps)."""

    recomputes_past_long_rope = True  # (its generate() restarts a sequence crossing it)

    @classmethod
    def configure(cls, config: ModelConfig, hf: dict[str, Any]) -> None:
        super().configure(config, hf)
        config.attention_bias = False  # transformers' Phi-3 has no projection biases
        if "rms_norm_eps" not in hf:
            config.rms_norm_eps = _RMS_NORM_EPS
        if config.rope_scaling and config.rope_spec().kind in ("longrope", "su"):
            # transformers gives the top-level field (default 4096) priority over the one in
            # rope_scaling: it is the length beyond which the long factors apply
            original = hf.get("original_max_position_embeddings", _ORIGINAL_MAX_POSITIONS)
            config.rope_scaling = {**config.rope_scaling,
                                   "original_max_position_embeddings": original}
            _check_factors(config)

    @classmethod
    def layer_windows(cls, hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        return (hf.get("sliding_window"),) * num_layers

    def checkpoint_tensors(self, name: str, tensor: Any) -> Iterable[tuple[str, Any]]:
        path, _, leaf = name.rpartition(".")
        base, _, module = path.rpartition(".")
        parts = self._fused_parts(module)
        layout = self._layout(path, leaf) if parts else None
        if parts is None or layout is None:  # not fused, or a tensor its loader takes whole
            yield name, tensor
        elif layout.output_dim is not None and (_size(tensor, layout.output_dim) * layout.pack
                                                == sum(rows for _, rows in parts)):
            yield from split_fused(name, tensor, [(p, rows // layout.pack) for p, rows in parts],
                                   dim=layout.output_dim)
        else:  # one value for the whole projection (a per-tensor scale): each part has it
            for part, _ in parts:
                yield f"{base}.{part}.{leaf}", tensor

    def _layout(self, path: str, leaf: str) -> ParamLayout | None:
        """Where the linear layer at `path` keeps the outputs of its parameter `leaf`."""
        try:
            module = self.get_submodule(path)
        except AttributeError:
            return None  # no such layer: loading names the tensor
        return module.layouts.get(leaf) if isinstance(module, Linear) else None

    def _fused_parts(self, module: str) -> list[tuple[str, int]] | None:
        """The checkpoint's fused projection `module` as (part name, output rows)."""
        cfg = self.config
        if module == "qkv_proj":
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            return [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
        if module == "gate_up_proj":
            return [("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)]
        return None


def _check_factors(config: ModelConfig) -> None:
    """LongRoPE's factor lists hold one entry per rotated pair of dims."""
    spec = config.rope_spec()
    for key in ("short_factor", "long_factor"):
        factors = spec.scaling.get(key)
        if not isinstance(factors, list) or len(factors) != spec.rotary_dim // 2:
            raise ValueError(f"config field rope_scaling.{key} must be a list of "
                             f"{spec.rotary_dim // 2} numbers (rotary dims / 2)")


def _size(tensor: Any, dim: int) -> int:
    """Length of `dim` of a tensor or a lazy safetensors slice."""
    shape = tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape()
    return int(shape[dim]) if len(shape) > dim else 1
