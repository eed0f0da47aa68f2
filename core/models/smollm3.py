"""SmolLM3: Llama whose layers skip RoPE where `no_rope_layers` says 0 (NoPE layers), with
tied embeddings by default.

`no_rope_layers` (1: RoPE, 0: none) defaults to every `no_rope_layer_interval`-th layer
without RoPE (3 of 4 with it). With `use_sliding_window`, configs that do not list
`layer_types` window the NoPE layers, as transformers' SmolLM3Config computes them; the
attention mask follows `layer_types`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pkv.core.layers.rotary import RotaryEmbedding
from pkv.core.models.base import BuildContext
from pkv.core.models.config import ModelConfig
from pkv.core.models.llama import LlamaForCausalLM
from pkv.core.models.registry import windows_from_layer_types


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama with NoPE layers."""

    default_rope_theta = 2000000.0
    default_tie_word_embeddings = True

    @classmethod
    def rope_layers(cls, hf: dict[str, Any], num_layers: int) -> list[bool]:
        """Per layer: whether it applies RoPE."""
        flags = hf.get("no_rope_layers")
        if flags is None:
            interval = hf.get("no_rope_layer_interval", 4)
            if not isinstance(interval, int) or interval < 1:
                raise ValueError(f"config field no_rope_layer_interval={interval!r} must be "
                                 f"an integer >= 1")
            flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
        if len(flags) != num_layers or any(f not in (0, 1) for f in flags):
            raise ValueError(f"config field no_rope_layers must list 0 or 1 for each of the "
                             f"{num_layers} layers")
        return [bool(f) for f in flags]

    @classmethod
    def layer_windows(cls, hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        rope = cls.rope_layers(hf, num_layers)
        windowed = hf.get("use_sliding_window") and hf.get("sliding_window") is not None
        default = ["sliding_attention" if windowed and not r else "full_attention" for r in rope]
        return windows_from_layer_types(hf, num_layers, default)

    def make_layer(self, cfg: ModelConfig, i: int, rope: RotaryEmbedding | None,
                   ctx: BuildContext) -> nn.Module:
        uses_rope = self.rope_layers(cfg.hf, cfg.num_hidden_layers)[i]
        return super().make_layer(cfg, i, rope if uses_rope else None, ctx)
