"""Which architectures pkv runs, and the family file that runs each (imported on demand)."""

from __future__ import annotations

import importlib
from typing import Any

# config.json `architectures` entry -> family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
    "GraniteForCausalLM": "granite",
    "SmolLM3ForCausalLM": "smollm3",
    # pooling checkpoints: encoders, and decoders saved without their LM head
    "BertModel": "bert",
    "BertForSequenceClassification": "bert_classifier",
    "LlamaModel": "llama",
    "MistralModel": "mistral",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
}

# Decoders saved without their LM head (embedding checkpoints: tensor names lack `model.`).
HEADLESS_DECODERS = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
# The architectures above that are not text generators, and the task each serves by default
# (`EngineConfig.task`): embeddings, or a cross-encoder's scores.
POOLING_TASKS = {"BertModel": "embed", "BertForSequenceClassification": "classify",
                 **{arch: "embed" for arch in HEADLESS_DECODERS}}

# family -> "module:class" under pkv.core.models
FAMILIES = {
    "llama": "llama:LlamaForCausalLM",
    "mistral": "llama:MistralForCausalLM",
    "qwen2": "llama:Qwen2ForCausalLM",
    "qwen3": "qwen3:Qwen3ForCausalLM",
    "qwen3_moe": "qwen3_moe:Qwen3MoeForCausalLM",
    "mixtral": "mixtral:MixtralForCausalLM",
    "gemma2": "gemma2:Gemma2ForCausalLM",
    "gemma3": "gemma3:Gemma3ForCausalLM",
    "phi3": "phi3:Phi3ForCausalLM",
    "olmo2": "olmo2:Olmo2ForCausalLM",
    "granite": "granite:GraniteForCausalLM",
    "smollm3": "smollm3:SmolLM3ForCausalLM",
    "bert": "bert:BertEmbeddingModel",
    "bert_classifier": "bert:BertForSequenceClassification",
}

# family -> transformers' model_type (config.json "model_type")
MODEL_TYPES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "gemma2": "gemma2", "gemma3": "gemma3_text",
    "phi3": "phi3", "olmo2": "olmo2", "granite": "granite", "smollm3": "smollm3",
    "bert": "bert", "bert_classifier": "bert",
}


def family_of(family: str) -> Any:
    """The model class of `family` (a `CausalLM` subclass)."""
    module, _, name = FAMILIES[family].partition(":")
    return getattr(importlib.import_module(f"pkv.core.models.{module}"), name)


def windows_from_layer_types(hf: dict[str, Any], num_layers: int,
                             default: list[str] | None = None) -> tuple[int | None, ...]:
    """Per-layer sliding windows from `layer_types` ("sliding_attention" / "full_attention"),
    as transformers 5.x writes them; `default` where a config predates the field."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types") or default or ["full_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"config field layer_types has {len(types)} entries for "
                         f"{num_layers} layers")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"config field layer_types holds {unknown}, which pkv does not run")
    if "sliding_attention" in types and window is None:
        raise ValueError("config field layer_types names sliding layers but sliding_window "
                         "is not set")
    return tuple(window if t == "sliding_attention" else None for t in types)
