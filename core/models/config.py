"""ModelConfig: the architecture of a decoder-only model, read from config.json or GGUF.

The common shapes are fields; what only one family reads stays in `hf` (the config dict),
read by that family's file. Validation happens here, before any weights load: an
unsupported architecture, a missing field, an unknown RoPE scaling, or a field that changes
the computation in a way pkv does not implement is one error naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pkv.core.layers.rotary import ROPE_TYPES, RopeSpec
from pkv.core.models.registry import ARCHITECTURES, HEADLESS_DECODERS, family_of

# Config fields that change the computation, the families that implement them, and the
# values that mean "off" (accepted anywhere).
_FAMILY_FIELDS: dict[str, tuple[set[str], tuple[Any, ...]]] = {
    "partial_rotary_factor": ({"phi3"}, (None, 1, 1.0)),
    "attn_logit_softcapping": ({"gemma2", "gemma3"}, (None,)),
    "final_logit_softcapping": ({"gemma2", "gemma3"}, (None,)),
    "embedding_multiplier": ({"granite"}, (None, 1, 1.0)),
    "residual_multiplier": ({"granite"}, (None, 1, 1.0)),
    "attention_multiplier": ({"granite"}, (None,)),
    "logits_scaling": ({"granite"}, (None, 1, 1.0)),
    "mlp_bias": (set(), (None, False)),
    "use_bidirectional_attention": (set(), (None, False)),
    "attention_chunk_size": (set(), (None,)),
    # (transformers' Qwen3-MoE has no shared expert and ignores the field)
    "shared_expert_intermediate_size": ({"qwen3_moe"}, (None, 0)),
    "use_qk_norm": (set(), (None, False)),
}


# Fields read as sizes, as numbers, as mappings: checked when the config is read, so that a
# `"64"` or a `-5` is one line naming the field (from `--check` too), not a crash deep in a
# layer's constructor once weights load.
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
_NUMBERS = ("rms_norm_eps", "layer_norm_eps", "rope_theta", "partial_rotary_factor")
_MAPPINGS = ("rope_scaling", "rope_parameters", "quantization_config")
# What each RoPE scaling kind reads besides its theta (LongRoPE's factors: the family's
# own check, phi3.py).
_ROPE_NEEDS = {"linear": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                          "original_max_position_embeddings")}


def _check_kinds(cfg: dict[str, Any]) -> None:
    for key in _SIZES:
        value = cfg.get(key)
        if value is not None and not _positive(value, int):
            raise ValueError(f"config field {key}={value!r} must be a positive integer")
    for key in _NUMBERS:
        value = cfg.get(key)
        if value is not None and not _positive(value, (int, float)):
            raise ValueError(f"config field {key}={value!r} must be a positive number")
    for key in _MAPPINGS:
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ValueError(f"config field {key} must be a mapping, got {cfg[key]!r}")


def _check_rope(rope: dict[str, Any], kind: str) -> None:
    for key in ("rope_theta", "factor", *_ROPE_NEEDS.get(kind, ())):
        value = rope.get(key)
        if value is None and key in _ROPE_NEEDS.get(kind, ()):
            raise ValueError(f"config field rope_scaling of type {kind!r} lacks {key!r}")
        if value is not None and not _positive(value, (int, float)):
            raise ValueError(f"config field rope_scaling.{key}={value!r} must be a positive "
                             "number")


def _positive(value: Any, kinds: type | tuple[type, ...]) -> bool:
    return isinstance(value, kinds) and not isinstance(value, bool) and 0 < value < math.inf


def eos_token_ids(value: Any, where: str) -> tuple[int, ...]:
    """An eos_token_id field: one id, a list of them, or none (0 is an id); `where` opens
    the error ("config field ", a file's name)."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"{where}eos_token_id={value!r} must be a token id or a list of them")
    return tuple(ids)


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """One view of the RoPE settings: transformers 5.x keeps them in `rope_parameters`
    (per layer type for Gemma 3), 4.x in `rope_theta`, `rope_scaling` and top-level fields."""
    params: dict[str, Any] = {}
    for key in ("partial_rotary_factor",):
        if cfg.get(key) is not None:
            params[key] = cfg[key]
    if cfg.get("rope_theta") is not None:
        params["rope_theta"] = cfg["rope_theta"]
    # transformers takes rope_scaling in place of rope_parameters where a config has both
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if "full_attention" in rope:  # per layer type: the global layers' settings
        rope = rope["full_attention"] or {}
    params.update(rope)
    # and a top-level original_max_position_embeddings over theirs
    if cfg.get("original_max_position_embeddings") is not None:
        params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return params


@dataclass(slots=True)
class ModelConfig:
    """Shapes and constants of a decoder-only model."""

    architecture: str  # the family: llama, qwen3, gemma2, ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None
    torch_dtype: str | None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0
    # per layer: the sliding window (None: global attention)
    layer_windows: tuple[int | None, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # config.json's architecture that pkv matched ("" for other formats): a decoder saved
    # as `Qwen3Model` & co. has no LM head and no `model.` prefix on its tensor names.
    hf_architecture: str = ""
    hf: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def headless(self) -> bool:
        """A decoder saved without its LM head (an embedding model)."""
        return self.hf_architecture in HEADLESS_DECODERS

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        archs = [archs] if isinstance(archs, str) else archs  # (transformers writes a list)
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"pkv runs {', '.join(ARCHITECTURES)}")
        family = ARCHITECTURES[arch]
        model_cls = family_of(family)
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        for key in (*required, *model_cls.required_fields):
            if cfg.get(key) is None:
                raise ValueError(f"config of {arch} lacks the field {key!r}")
        _check_kinds(cfg)
        heads = cfg["num_attention_heads"]
        rope = _rope_parameters(cfg)
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind not in ROPE_TYPES:
            raise ValueError(f"config field rope_scaling.rope_type={kind!r} is not supported "
                             f"({', '.join(ROPE_TYPES)})")
        _check_rope(rope, kind)
        scaling = None if kind == "default" else rope
        for key, (families, neutral) in _FAMILY_FIELDS.items():
            if family not in families and cfg.get(key) not in neutral:
                raise ValueError(f"config field {key}={cfg[key]!r} changes the computation, "
                                 f"and pkv does not implement it for {arch}")
        config = cls(
            architecture=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or 0,
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta") or model_cls.default_rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=_flag(cfg, "tie_word_embeddings",
                                      model_cls.default_tie_word_embeddings),
            attention_bias=(getattr(model_cls, "reads_attention_bias", True)
                            and _flag(cfg, "attention_bias", False)) or model_cls.qkv_bias,
            rope_scaling=scaling,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_token_ids(cfg.get("eos_token_id"), "config field "),
            hidden_act=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
            partial_rotary_factor=float(rope.get("partial_rotary_factor") or 1.0),
            hf_architecture=arch,
            hf=cfg,
        )
        if config.headless:  # its (unused) LM head shares the embedding: no memory of its own
            config.tie_word_embeddings = True
        model_cls.configure(config, cfg)
        config.validate()
        return config

    def validate(self) -> None:
        """Checks every family shares; family-specific ones are in `configure`."""
        if len(self.layer_windows) != self.num_hidden_layers:
            self.layer_windows = (None,) * self.num_hidden_layers
        for window in self.layer_windows:
            if window is not None and window < 1:
                raise ValueError(f"config field sliding_window={window} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"config field num_experts_per_tok={self.num_experts_per_tok} "
                                 f"must be in [1, {self.num_experts}] (the number of experts)")
            if self.moe_intermediate_size < 1:
                raise ValueError("config of a mixture of experts lacks the experts' "
                                 "intermediate size")
        elif self.intermediate_size < 1:
            raise ValueError("config lacks the field 'intermediate_size'")

    def rope_spec(self, theta: float | None = None,
                  scaling: dict[str, Any] | None = None) -> RopeSpec:
        """The RoPE of the global layers, or another base/scaling (Gemma 3's local layers)."""
        rotary_dim = int(self.head_dim * self.partial_rotary_factor)
        return RopeSpec(theta=theta or self.rope_theta, rotary_dim=rotary_dim,
                        scaling=dict((self.rope_scaling if scaling is None else scaling) or {}),
                        max_position_embeddings=self.max_position_embeddings)

    @property
    def num_parameters(self) -> int:
        h, v = self.hidden_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        if self.num_experts:
            mlp = 3 * h * self.moe_intermediate_size * self.num_experts + h * self.num_experts
        else:
            mlp = 3 * h * self.intermediate_size
        per_layer = h * (q + 2 * kv) + q * h + mlp + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + head


def _flag(cfg: dict[str, Any], key: str, default: bool) -> bool:
    """A true/false config field (a string "false" is not False: refused, as transformers
    does, rather than read as true)."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config field {key}={value!r} must be true or false")
    return value
