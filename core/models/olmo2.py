"""OLMo 2: Llama with the norms moved behind the sub-layers, and q/k norms over the whole
projection.

    x -> embed -> N x [x + norm(attn(x)); x + norm(mlp(x))] -> rmsnorm -> lm_head

q and k are RMS-normalized across all heads at once (one weight of num_heads * head_dim),
before they are split into heads and rotated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pkv.core.layers.attention import Attention, AttentionOptions
from pkv.core.layers.attention_backend import AttentionMetadata
from pkv.core.layers.norm import RMSNorm
from pkv.core.models.base import BuildContext, DecoderModel, KVCache
from pkv.core.models.config import ModelConfig
from pkv.core.models.llama import LlamaForCausalLM

_RMS_NORM_EPS = 1e-5  # transformers' Olmo2Config default


class Olmo2RMSNorm(RMSNorm):
    """OLMo 2 multiplies by the weight before rounding to the compute dtype (Llama after)."""

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


class Olmo2DecoderLayer(nn.Module):
    """x + norm(attn(x)), then x + norm(mlp(x)): post-sub-layer norms, none before."""

    def __init__(self, cfg: ModelConfig, attn: Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = attn
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fused_norms(self) -> tuple[dict[str, RMSNorm], float]:
        """The norms in csrc/decoder_cpu.cpp's slots: only the two after the sub-layers."""
        return {"attn_out": self.post_attention_layernorm,
                "mlp_out": self.post_feedforward_layernorm}, 1.0

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As Llama's layer: `h` is the previous layer's output not yet added to `residual`
        (None for the first layer); returns this layer's likewise."""
        x = h if residual is None else residual + h  # [T, hidden]
        x = x + self.post_attention_layernorm(self.self_attn(x, positions, kv_cache, meta))
        return self.post_feedforward_layernorm(self.mlp(x)), x


class Olmo2ForCausalLM(LlamaForCausalLM):
    """Llama with post-sub-layer norms and whole-projection q/k norms."""

    layer_cls = Olmo2DecoderLayer

    @classmethod
    def configure(cls, config: ModelConfig, hf: dict[str, Any]) -> None:
        super().configure(config, hf)
        if "rms_norm_eps" not in hf:
            config.rms_norm_eps = _RMS_NORM_EPS

    def make_decoder(self, cfg: ModelConfig, ctx: BuildContext) -> DecoderModel:
        decoder = super().make_decoder(cfg, ctx)
        decoder.norm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # the final norm too
        return decoder

    def attention_options(self, cfg: ModelConfig, i: int) -> AttentionOptions:
        return AttentionOptions(sliding_window=cfg.layer_windows[i], qk_norm="full",
                                qk_norm_cls=Olmo2RMSNorm, norm_eps=cfg.rms_norm_eps)
