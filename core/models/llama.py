"""The Llama family as a textbook decoder, and the families that are Llama with one change
(Mistral: a sliding window on every layer; Qwen2: q/k/v biases, windows per layer type).

    x -> embed -> N x [x + attn(rmsnorm(x)); x + mlp(rmsnorm(x))] -> rmsnorm -> lm_head

Parameter names follow Hugging Face, except that q/k/v and gate/up are fused into one
matmul each (`qkv_proj`, `gate_up_proj`); `load_weights` maps checkpoint names onto them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from pkv.core.layers.attention import Attention, AttentionOptions
from pkv.core.layers.attention_backend import AttentionMetadata
from pkv.core.layers.embedding import VocabEmbedding
from pkv.core.layers.mlp import GatedMLP
from pkv.core.layers.norm import RMSNorm
from pkv.core.layers.rotary import RotaryEmbedding
from pkv.core.models.base import (BuildContext, CausalLM, DecoderModel, KVCache, add_norm,
                                  checkpoint_name)
from pkv.core.models.config import ModelConfig
from pkv.core.models.registry import windows_from_layer_types

__all__ = ["Attention", "DecoderLayer", "LlamaForCausalLM", "RMSNorm", "RotaryEmbedding",
           "VocabEmbedding", "checkpoint_name"]


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)): pre-norm sub-layers."""

    def __init__(self, cfg: ModelConfig, attn: Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def fused_norms(self) -> tuple[dict[str, RMSNorm], float]:
        """The norms in csrc/decoder_cpu.cpp's slots (in, attn_out, mlp_in, mlp_out) and the
        multiplier of the sub-layers' outputs: how the C++ decoder computes this layer."""
        return {"in": self.input_layernorm, "mlp_in": self.post_attention_layernorm}, 1.0

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """`h` is the previous layer's output, not yet added to the residual stream (the
        first layer gets the embeddings and no residual); returns this layer's likewise."""
        h, residual = add_norm(self.input_layernorm, h, residual)
        h = self.self_attn(h, positions, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(CausalLM):
    """Llama, and the base of the Llama-shaped families: they override the hooks below."""

    required_fields: tuple[str, ...] = ("intermediate_size",)
    default_rope_theta = 10000.0
    default_tie_word_embeddings = False
    layer_cls: type[nn.Module] = DecoderLayer  # built with (cfg, attention, mlp)
    qkv_bias = False  # q/k/v biases whatever the config says (Qwen2)
    reads_attention_bias = True  # `attention_bias` adds biases (transformers' Mistral: none)
    # A sequence crossing LongRoPE's threshold is recomputed with the long table (transformers
    # does so for Phi-3; other families take the long table for the tokens past it alone).
    recomputes_past_long_rope = False
    # transformers' Llama-style attention biases o_proj too when `attention_bias` is set
    o_proj_follows_attention_bias = True

    @classmethod
    def configure(cls, config: ModelConfig, hf: dict[str, Any]) -> None:
        """Read the family's own fields from `hf` into `config`; raise on what pkv lacks."""
        config.layer_windows = cls.layer_windows(hf, config.num_hidden_layers)

    @classmethod
    def layer_windows(cls, hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        # transformers' Llama (and Granite, OLMo2) attend over everything whatever a config's
        # sliding_window or layer_types say
        return (None,) * num_layers

    def make_decoder(self, cfg: ModelConfig, ctx: BuildContext) -> DecoderModel:
        rope = RotaryEmbedding(cfg.rope_spec(), cfg.head_dim, ctx.max_len)
        layers = [self.make_layer(cfg, i, rope, ctx) for i in range(cfg.num_hidden_layers)]
        return DecoderModel(cfg, layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), rope,
                            ctx.plan)

    def make_layer(self, cfg: ModelConfig, i: int, rope: RotaryEmbedding | None,
                   ctx: BuildContext) -> nn.Module:
        return self.layer_cls(cfg, self.make_attention(cfg, i, rope, ctx),
                              self.make_mlp(cfg, i, ctx))

    def attention_options(self, cfg: ModelConfig, i: int) -> AttentionOptions:
        """How layer i's attention differs from Llama's (biases follow the config, set in
        `make_attention`)."""
        return AttentionOptions(sliding_window=cfg.layer_windows[i], norm_eps=cfg.rms_norm_eps)

    def make_attention(self, cfg: ModelConfig, i: int, rope: RotaryEmbedding | None,
                       ctx: BuildContext) -> Attention:
        options = replace(self.attention_options(cfg, i), bias=cfg.attention_bias,
                          o_bias=cfg.attention_bias and self.o_proj_follows_attention_bias)
        return Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                         cfg.head_dim, rope, ctx.backend, ctx.method, ctx.plan, options)

    def make_mlp(self, cfg: ModelConfig, i: int, ctx: BuildContext) -> nn.Module:
        return GatedMLP(cfg.hidden_size, ctx.plan.intermediate, cfg.hidden_act, ctx.method,
                        ctx.plan)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with `sliding_window` on every layer (4,096 where the config has no such key,
    as transformers' MistralConfig; null: none); a config with `layer_types` is Ministral's
    to transformers, each layer windowed as its type says."""

    o_proj_follows_attention_bias = False
    reads_attention_bias = False

    @classmethod
    def layer_windows(cls, hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        if hf.get("layer_types") is not None:
            return windows_from_layer_types(hf, num_layers)
        return (hf.get("sliding_window", 4096),) * num_layers


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v biases (always, whatever the config says) and, with
    `use_sliding_window`, windows on the layers from `max_window_layers` on."""

    qkv_bias = True
    o_proj_follows_attention_bias = False

    @classmethod
    def layer_windows(cls, hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        return qwen_layer_windows(hf, num_layers)


def qwen_layer_windows(hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Qwen's rule: windows only with `use_sliding_window`, from `max_window_layers` on."""
    if not hf.get("use_sliding_window"):
        return (None,) * num_layers
    first = hf.get("max_window_layers", 28)
    default = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return windows_from_layer_types(hf, num_layers, default)
