"""What llama.cpp's convert_hf_to_gguf.py did to each architecture pkv runs, for
plugins/weights/gguf.py to undo: tensor names, q/k row order, Gemma's norm offset, stacked
experts, and the config fields only one architecture has.

Where the converter writes nothing, llama.cpp runs a fixed value, and so does pkv: Gemma's
window pattern (2, 6) and attention scale, Gemma 3's local RoPE base (10000), SmolLM3's
RoPE-less layers (every 4th), Qwen3-MoE's renormalized top-k. Config fields no GGUF holds
(Qwen2/Qwen3/SmolLM3 windows, Gemma 2's untied head, Granite's head_dim) cannot come back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class GGUFFile(Protocol):
    """What an architecture's field reader needs of an open file (gguf.py's GGUFFile, which
    reads this module's tables and so is not imported here)."""

    arch: str

    def key(self, name: str, default: Any = None) -> Any:
        """The architecture's field `{arch}.{name}`."""

    def positive(self, name: str, default: Any = None) -> int:
        """A count above zero (`default` where the file may leave it out); else a ValueError
        naming the field."""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape in PyTorch order, by GGUF name."""


def decimal(value: Any) -> Any:
    """GGUF stores floats as float32: 1e-06 reads back as 9.99999997e-07. The shortest
    decimal that rounds to the same float32 is what config.json held."""
    if isinstance(value, float):
        return float(str(np.float32(value)))
    return value


# GGUF layer tensor -> Hugging Face module, as most converters name them
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_POST_NORMS = {"post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}
_GEMMA_NAMES = {**_POST_NORMS, "ffn_norm": "pre_feedforward_layernorm"}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
EXPERT_PARTS = ("gate", "up", "down")  # ffn_{part}_exps
# tensors that become config, not weights
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _llama_fields(g: GGUFFile, cfg: dict[str, Any]) -> None:
    """llama is also Mistral (a window on every layer) and Mixtral (experts). llama.cpp's
    converter writes no window for them; a file that has `llama.attention.sliding_window`
    runs it."""
    window = g.key("attention.sliding_window")
    if g.key("expert_count"):
        cfg.update(architectures=["MixtralForCausalLM"],
                   num_local_experts=g.positive("expert_count"),
                   num_experts_per_tok=g.positive("expert_used_count"))
    elif window:
        cfg["architectures"] = ["MistralForCausalLM"]
    if window:
        cfg["sliding_window"] = int(window)


def _qwen3moe_fields(g: GGUFFile, cfg: dict[str, Any]) -> None:
    """Every layer is MoE (gguf-py names no dense qwen3moe MLP) and llama.cpp always
    renormalizes the top-k weights."""
    experts, used = g.positive("expert_count"), g.positive("expert_used_count")
    width = g.key("expert_feed_forward_length") or cfg["intermediate_size"] // used
    cfg.update(num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=int(width),
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def _gemma_fields(g: GGUFFile, cfg: dict[str, Any], pattern: int, large_layers: int) -> None:
    """Gemma's window pattern and attention scale are not in the file: llama.cpp fixes them
    (a window on all layers but every `pattern`-th; scale 1/sqrt(head_dim), except for the
    27B models, whose query_pre_attn_scalar is hidden / heads)."""
    cfg["sliding_window"] = int(g.key("attention.sliding_window", 4096))
    swa = g.key("attention.sliding_window_pattern")
    if isinstance(swa, list):
        is_sliding = list(swa)
    else:
        every = g.positive("attention.sliding_window_pattern", pattern)
        is_sliding = [(i + 1) % every != 0 for i in range(cfg["num_hidden_layers"])]
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in is_sliding]
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"]
                                    if cfg["num_hidden_layers"] == large_layers
                                    else cfg["head_dim"])
    cfg["hidden_activation"] = "gelu_pytorch_tanh"


def _gemma2_fields(g: GGUFFile, cfg: dict[str, Any]) -> None:
    _gemma_fields(g, cfg, pattern=2, large_layers=46)
    # llama.cpp's defaults where the converter left the caps out
    cfg["attn_logit_softcapping"] = float(g.key("attn_logit_softcapping", 50.0))
    cfg["final_logit_softcapping"] = float(g.key("final_logit_softcapping", 30.0))


def _gemma3_fields(g: GGUFFile, cfg: dict[str, Any]) -> None:
    """The global layers' RoPE is the file's; the sliding layers' base is fixed at 10000 by
    llama.cpp unless the file has `rope.freq_base_swa`."""
    _gemma_fields(g, cfg, pattern=6, large_layers=62)
    local = {"rope_type": "default", "rope_theta": float(g.key("rope.freq_base_swa", 10000.0))}
    cfg["rope_parameters"] = {"full_attention": g.rope_parameters(1_000_000.0),
                              "sliding_attention": local}
    cap = g.key("final_logit_softcapping")
    cfg["final_logit_softcapping"] = None if cap is None else float(cap)
    cfg["attn_logit_softcapping"] = None


def _phi3_fields(g: GGUFFile, cfg: dict[str, Any]) -> None:
    """A window of 0 means none (Phi-4); LongRoPE's factors are the rope_factors tensors."""
    window = g.key("attention.sliding_window")
    cfg["sliding_window"] = int(window) if window else None
    original = g.key("rope.scaling.original_context_length")
    if original is not None:
        cfg["original_max_position_embeddings"] = int(original)
    if "rope_factors_long.weight" not in g.names:
        return
    original = g.positive("rope.scaling.original_context_length")  # LongRoPE's, needed
    if original < 2:
        raise ValueError(f"{g.arch}.rope.scaling.original_context_length is {original}: "
                         "LongRoPE needs a context of at least 2")
    rope = cfg["rope_parameters"]
    rope.update(rope_type="longrope", original_max_position_embeddings=int(original),
                long_factor=[decimal(x) for x in g.read("rope_factors_long.weight").tolist()],
                short_factor=[decimal(x) for x in g.read("rope_factors_short.weight").tolist()])
    scale = cfg["max_position_embeddings"] / int(original)
    default = math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1 else 1.0
    attention = g.key("rope.scaling.attn_factor")
    if attention is not None and abs(float(attention) - default) > 1e-6:
        rope["attention_factor"] = float(attention)


def _olmo2_fields(g: GGUFFile, cfg: dict[str, Any]) -> None:
    """OLMo 2 has no window; a file that has one (OLMo 3's converter) also has the
    per-layer pattern."""
    if window := g.key("attention.sliding_window"):
        pattern = g.key("attention.sliding_window_pattern")
        if not isinstance(pattern, list):
            raise ValueError(f"{g.path.name}: olmo2.attention.sliding_window is set but "
                             "olmo2.attention.sliding_window_pattern does not list the layers")
        cfg["sliding_window"] = int(window)
        cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]


def _granite_fields(g: GGUFFile, cfg: dict[str, Any]) -> None:
    """The converter renames Granite's multipliers to scales."""
    cfg.update(attention_multiplier=float(g.key("attention.scale", cfg["head_dim"] ** -0.5)),
               embedding_multiplier=float(g.key("embedding_scale", 1.0)),
               residual_multiplier=float(g.key("residual_scale", 1.0)),
               logits_scaling=float(g.key("logit_scale", 1.0)))


def _smollm3_fields(g: GGUFFile, cfg: dict[str, Any]) -> None:
    """llama.cpp skips RoPE on every 4th layer, as SmolLM3's config does by default (the
    file has no field for it)."""
    cfg["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(cfg["num_hidden_layers"])]
    cfg["use_sliding_window"] = False


# BERT's converter (conversion/bert.py): the encoder's own names, no RoPE, post-norms.
_BERT_LAYER_NAMES = {
    "attn_q": "attention.self.query", "attn_k": "attention.self.key",
    "attn_v": "attention.self.value", "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm", "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm",
}
_BERT_GLOBAL_NAMES = {
    "token_embd": "embeddings.word_embeddings", "token_types": "embeddings.token_type_embeddings",
    "position_embd": "embeddings.position_embeddings", "token_embd_norm": "embeddings.LayerNorm",
}
# gguf-py's PoolingType: what `{arch}.pooling_type` says, as sentence-transformers names it
POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}


def _bert_fields(g: GGUFFile, cfg: dict[str, Any]) -> None:
    """An encoder's config: LayerNorm's epsilon, token types and positions from their
    tables' shapes; GELU, which the converter does not record (BERT embedders use erf's)."""
    shapes = g.shapes()
    cfg.update(layer_norm_eps=float(g.key("attention.layer_norm_epsilon", 1e-12)),
               type_vocab_size=shapes.get("token_types.weight", (1,))[0],
               max_position_embeddings=shapes.get("position_embd.weight",
                                                  (cfg["max_position_embeddings"],))[0],
               hidden_act="gelu", tie_word_embeddings=False)
    for key in ("rms_norm_eps", "rope_parameters", "num_key_value_heads", "head_dim",
                "attention_bias"):
        cfg.pop(key, None)


def pooling_fields(g: GGUFFile, cfg: dict[str, Any]) -> None:
    """`{arch}.pooling_type` (an embedding model's file) as the config's `pooling_mode`."""
    kind = g.key("pooling_type")
    if kind is None or int(kind) == 0:
        return
    if int(kind) not in POOLING_TYPES:
        raise ValueError(f"GGUF {g.arch}.pooling_type {kind} is not a pooling pkv runs "
                         f"({', '.join(f'{k} {v}' for k, v in POOLING_TYPES.items())})")
    cfg["pooling_mode"] = POOLING_TYPES[int(kind)]


@dataclass(frozen=True)
class Arch:
    """How llama.cpp's converter wrote one architecture string."""

    hf_arch: str
    permuted_qk: bool = False  # a LlamaModel converter: q/k rows in llama.cpp's RoPE order
    norm_offset: float = 0.0  # Gemma: `*norm.weight` stored as offset + weight
    names: dict[str, str] = field(default_factory=dict)  # beyond LAYER_NAMES
    # experts: (the MoE block, HF name of each of EXPERT_PARTS, the router)
    experts: tuple[str, tuple[str, str, str], str] | None = None
    # the config fields only this architecture has, from the file
    fields: Callable[[GGUFFile, dict[str, Any]], None] | None = None
    layer_prefix: str = "model.layers"  # blk.N. -> f"{layer_prefix}.N."
    global_names: dict[str, str] = field(default_factory=lambda: GLOBAL_NAMES)


ARCHS = {
    "llama": Arch("LlamaForCausalLM", permuted_qk=True, fields=_llama_fields,
                  experts=("block_sparse_moe", ("w1", "w3", "w2"), "gate")),
    "qwen2": Arch("Qwen2ForCausalLM"),
    "qwen3": Arch("Qwen3ForCausalLM"),
    "qwen3moe": Arch("Qwen3MoeForCausalLM", fields=_qwen3moe_fields,
                     experts=("mlp", ("gate_proj", "up_proj", "down_proj"), "gate")),
    "gemma2": Arch("Gemma2ForCausalLM", norm_offset=1.0, names=_GEMMA_NAMES,
                   fields=_gemma2_fields),
    "gemma3": Arch("Gemma3ForCausalLM", norm_offset=1.0, names=_GEMMA_NAMES,
                   fields=_gemma3_fields),
    # Phi-3's ffn_up is the checkpoint's fused gate_up_proj (the model file splits it)
    "phi3": Arch("Phi3ForCausalLM", names={"ffn_up": "mlp.gate_up_proj"}, fields=_phi3_fields),
    "olmo2": Arch("Olmo2ForCausalLM", names=_POST_NORMS, fields=_olmo2_fields),
    "granite": Arch("GraniteForCausalLM", permuted_qk=True, fields=_granite_fields),
    "smollm3": Arch("SmolLM3ForCausalLM", permuted_qk=True, fields=_smollm3_fields),
    "bert": Arch("BertModel", names=_BERT_LAYER_NAMES, fields=_bert_fields,
                 layer_prefix="encoder.layer", global_names=_BERT_GLOBAL_NAMES),
}
