"""IBM Granite (3.x): Llama with four constants from the config.

- `embedding_multiplier`: the embeddings are scaled by it;
- `residual_multiplier`: each sub-layer's output is scaled by it before it joins the residual;
- `attention_multiplier`: the attention scale, in place of head_dim ** -0.5;
- `logits_scaling`: the logits are divided by it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pkv.core.layers.attention import AttentionOptions
from pkv.core.layers.attention_backend import AttentionMetadata
from pkv.core.layers.norm import RMSNorm
from pkv.core.models.base import BuildContext, DecoderModel, KVCache, add_norm
from pkv.core.models.config import ModelConfig
from pkv.core.models.llama import DecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    """Llama's layer, its sub-layers' outputs scaled by `residual_multiplier`."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module, mlp: nn.Module,
                 residual_multiplier: float) -> None:
        super().__init__(cfg, attn, mlp)
        self.residual_multiplier = residual_multiplier

    def fused_norms(self) -> tuple[dict[str, RMSNorm], float]:
        """The norms in csrc/decoder_cpu.cpp's slots (Llama's) and the output multiplier."""
        return ({"in": self.input_layernorm, "mlp_in": self.post_attention_layernorm},
                self.residual_multiplier)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = add_norm(self.input_layernorm, h, residual)
        h = self.self_attn(h, positions, kv_cache, meta) * self.residual_multiplier
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    """Llama with embedding, residual, attention and logit multipliers."""

    def _multiplier(self, key: str) -> float:
        value = self.config.hf.get(key)
        return 1.0 if value is None else float(value)  # transformers' default for each

    def make_decoder(self, cfg: ModelConfig, ctx: BuildContext) -> DecoderModel:
        decoder = super().make_decoder(cfg, ctx)
        decoder.embed_scale = self._multiplier("embedding_multiplier")
        return decoder

    def make_layer(self, cfg: ModelConfig, i: int, rope: Any, ctx: BuildContext) -> nn.Module:
        return GraniteDecoderLayer(cfg, self.make_attention(cfg, i, rope, ctx),
                                   self.make_mlp(cfg, i, ctx),
                                   self._multiplier("residual_multiplier"))

    def attention_options(self, cfg: ModelConfig, i: int) -> AttentionOptions:
        return AttentionOptions(sliding_window=cfg.layer_windows[i],
                                scale=self._multiplier("attention_multiplier"),
                                norm_eps=cfg.rms_norm_eps)

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits / self._multiplier("logits_scaling")
