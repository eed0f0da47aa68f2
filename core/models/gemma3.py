"""Gemma 3 (text): Gemma 2's layer with an RMSNorm (1 + weight) over each head of q and of k
before RoPE, and RoPE per layer type: global layers use `rope_theta` (default 1e6) with the
config's scaling (e.g. linear x8), sliding layers the local base (`rope_local_base_freq` in
4.x configs, `rope_parameters["sliding_attention"]` in 5.x ones, default 10000). Where
`layer_types` is absent, one layer in `sliding_window_pattern` (default 6) is global.

Logits are soft-capped only when `final_logit_softcapping` is set. `attn_logit_softcapping`
is accepted and, as in transformers (whose Gemma 3 attention never passes it on), not
applied.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pkv.core.layers.attention import AttentionOptions
from pkv.core.layers.norm import GemmaRMSNorm
from pkv.core.layers.rotary import ROPE_TYPES, RotaryEmbedding
from pkv.core.models.base import BuildContext
from pkv.core.models.config import ModelConfig
from pkv.core.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2 plus per-head q/k norms and a second RoPE for the sliding layers."""

    default_rope_theta = 1_000_000.0
    sliding_window_pattern = 6
    defaults = {**Gemma2ForCausalLM.defaults, "attn_logit_softcapping": None,
                "final_logit_softcapping": None}

    @classmethod
    def configure(cls, config: ModelConfig, hf: dict[str, Any]) -> None:
        super().configure(config, hf)
        cls.local_rope(hf)  # an unknown local RoPE type fails before any weights load

    @classmethod
    def layer_pattern(cls, hf: dict[str, Any]) -> int:
        return hf.get("sliding_window_pattern") or cls.sliding_window_pattern

    @staticmethod
    def local_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """(base, scaling) of the sliding layers' RoPE."""
        params = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
        theta = params.get("rope_theta") or hf.get("rope_local_base_freq") or 10000.0
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in ROPE_TYPES:
            raise ValueError(f"config field rope_parameters.sliding_attention.rope_type="
                             f"{kind!r} is not supported ({', '.join(ROPE_TYPES)})")
        return float(theta), ({} if kind == "default" else dict(params))

    def layer_ropes(self, cfg: ModelConfig, ctx: BuildContext) -> list[RotaryEmbedding]:
        theta, scaling = self.local_rope(cfg.hf)
        full = RotaryEmbedding(cfg.rope_spec(), cfg.head_dim, ctx.max_len)
        local = RotaryEmbedding(cfg.rope_spec(theta=theta, scaling=scaling), cfg.head_dim,
                                ctx.max_len)
        return [full if window is None else local for window in cfg.layer_windows]

    def attention_options(self, cfg: ModelConfig, i: int) -> AttentionOptions:
        return replace(super().attention_options(cfg, i), qk_norm="head",
                       qk_norm_cls=GemmaRMSNorm, logits_soft_cap=None)
