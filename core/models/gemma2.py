"""Gemma 2: Llama with every sub-layer normed before and after, Gemma's RMSNorm (1 + weight),
an embedding scaled by sqrt(hidden), GeGLU (tanh GELU), the attention scale
`query_pre_attn_scalar ** -0.5`, attention and final logit soft-capping, and sliding-window
layers interleaved with global ones (sliding on even layers unless `layer_types` says).

    x -> embed * sqrt(hidden) -> N x [x + norm(attn(norm(x))); x + norm(mlp(norm(x)))]
      -> norm -> lm_head -> cap * tanh(logits / cap)

Checkpoint names need no mapping; the LM head is tied to the embedding by default.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pkv.core.layers.attention import Attention, AttentionOptions
from pkv.core.layers.attention_backend import AttentionMetadata
from pkv.core.layers.mlp import check_activation
from pkv.core.layers.norm import GemmaRMSNorm
from pkv.core.layers.rotary import RotaryEmbedding
from pkv.core.models.base import BuildContext, DecoderModel, KVCache, add_norm
from pkv.core.models.config import ModelConfig
from pkv.core.models.llama import LlamaForCausalLM
from pkv.core.models.registry import windows_from_layer_types


class GemmaDecoderLayer(nn.Module):
    """x + post_norm(attn(norm(x))), then x + post_norm(mlp(pre_norm(x)))."""

    def __init__(self, cfg: ModelConfig, attn: Attention, mlp: nn.Module) -> None:
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = attn
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def fused_norms(self) -> tuple[dict[str, GemmaRMSNorm], float]:
        """As `DecoderLayer.fused_norms`: all four slots of the C++ decoder are used."""
        return {"in": self.input_layernorm, "attn_out": self.post_attention_layernorm,
                "mlp_in": self.pre_feedforward_layernorm,
                "mlp_out": self.post_feedforward_layernorm}, 1.0

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As `DecoderLayer.forward`: `h` is not yet added to `residual` (None: first layer)."""
        h, residual = add_norm(self.input_layernorm, h, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2; Gemma 3 changes the attention (q/k norms, RoPE per layer type) on top."""

    layer_cls = GemmaDecoderLayer
    default_tie_word_embeddings = True
    sliding_window_pattern = 2  # layer i slides unless (i + 1) % pattern == 0
    # transformers' config defaults, for the fields a config.json may leave out
    defaults: dict[str, Any] = {"head_dim": 256, "query_pre_attn_scalar": 256,
                                "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                                "final_logit_softcapping": 30.0}

    @classmethod
    def setting(cls, hf: dict[str, Any], key: str) -> Any:
        """Config field `key` as transformers reads it (its default when absent)."""
        return hf.get(key, cls.defaults.get(key))

    @classmethod
    def configure(cls, config: ModelConfig, hf: dict[str, Any]) -> None:
        super().configure(config, hf)
        config.head_dim = cls.setting(hf, "head_dim") or config.head_dim
        # transformers' Gemma reads `hidden_activation` (a stray `hidden_act` is ignored)
        config.hidden_act = check_activation(hf.get("hidden_activation") or "gelu_pytorch_tanh",
                                             "hidden_activation")

    @classmethod
    def layer_windows(cls, hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        pattern = cls.layer_pattern(hf)
        default = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                   for i in range(num_layers)]
        hf = {**hf, "sliding_window": cls.setting(hf, "sliding_window")}
        return windows_from_layer_types(hf, num_layers, default)

    @classmethod
    def layer_pattern(cls, hf: dict[str, Any]) -> int:
        """Every how many layers one is global, for configs without `layer_types`."""
        return cls.sliding_window_pattern

    def make_decoder(self, cfg: ModelConfig, ctx: BuildContext) -> DecoderModel:
        ropes = self.layer_ropes(cfg, ctx)
        layers = [self.make_layer(cfg, i, rope, ctx) for i, rope in enumerate(ropes)]
        return DecoderModel(cfg, layers, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
                            ropes[0], ctx.plan, embed_scale=cfg.hidden_size**0.5)

    def layer_ropes(self, cfg: ModelConfig, ctx: BuildContext) -> list[RotaryEmbedding]:
        """Each layer's RoPE (Gemma 2: one for all)."""
        return [RotaryEmbedding(cfg.rope_spec(), cfg.head_dim, ctx.max_len)] * \
            cfg.num_hidden_layers

    def attention_options(self, cfg: ModelConfig, i: int) -> AttentionOptions:
        return AttentionOptions(sliding_window=cfg.layer_windows[i],
                                scale=self.setting(cfg.hf, "query_pre_attn_scalar") ** -0.5,
                                logits_soft_cap=self.setting(cfg.hf, "attn_logit_softcapping"),
                                norm_eps=cfg.rms_norm_eps)

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.setting(self.config.hf, "final_logit_softcapping")
        return logits if cap is None else torch.tanh(logits / cap) * cap
