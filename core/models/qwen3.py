"""Qwen3: Llama with an RMSNorm over each head of q and of k before RoPE, no q/k/v bias
(unless the config asks for one), and sliding windows by Qwen's rule.

Checkpoint names need no mapping: `self_attn.q_norm` / `self_attn.k_norm` are the
attention's own norms here too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pkv.core.layers.attention import AttentionOptions
from pkv.core.models.config import ModelConfig
from pkv.core.models.llama import LlamaForCausalLM, qwen_layer_windows


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with per-head q/k RMSNorm; windows from `max_window_layers` on."""

    @classmethod
    def layer_windows(cls, hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        return qwen_layer_windows(hf, num_layers)

    def attention_options(self, cfg: ModelConfig, i: int) -> AttentionOptions:
        return replace(super().attention_options(cfg, i), qk_norm="head")
