"""FP8 (e4m3) quantization of a model's linear weights, per channel or per tensor, in the
layout vLLM and compressed-tensors checkpoints use."""

from __future__ import annotations

from typing import Any

import torch

from pkv.core.models.llama import LlamaForCausalLM
from pkv.plugins.weights.fp8 import quantize_per_channel, quantize_per_tensor
from pkv.quantize.checkpoint import quantizable_weights, unquantized_tensors

STRATEGIES = ("channel", "tensor")


def checkpoint_tensors(model: LlamaForCausalLM, strategy: str) -> dict[str, torch.Tensor]:
    """Every tensor of the FP8 checkpoint under Hugging Face names."""
    quantize = quantize_per_channel if strategy == "channel" else quantize_per_tensor
    tensors = unquantized_tensors(model)
    for name, weight in quantizable_weights(model):
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = quantize(weight)
    return tensors


def quant_config(strategy: str) -> dict[str, Any]:
    """compressed-tensors' description of FP8 weights with dynamic per-token activations."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "symmetric": True, "dynamic": True},
        }},
    }
