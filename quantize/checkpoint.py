"""Write a quantized model as a Hugging Face folder: safetensors, config.json, tokenizer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pkv.core.layers.linear import Linear
from pkv.core.model_loader.loader import ModelSource, write_tokenizer
from pkv.core.models.llama import LlamaForCausalLM, checkpoint_name
from pkv.core.models.registry import MODEL_TYPES

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")


def quantizable_weights(model: LlamaForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint module name, float weight [N, K]) of every decoder linear, fused layers
    split back into their checkpoint parts (q/k/v, gate/up)."""
    for path, module in model.named_modules():
        if isinstance(module, Linear) and path != "lm_head":
            single = len(module.out_sizes) == 1
            for shard in range(len(module.out_sizes)):
                name = checkpoint_name(path, "weight", None if single else shard)
                yield name.removesuffix(".weight"), module.weight[module.shard_rows(shard)]


def unquantized_tensors(model: LlamaForCausalLM,
                        dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """Embedding, norms, LM head and linear biases, in `dtype`, under checkpoint names."""
    tensors = {}
    linears = {path: m for path, m in model.named_modules()
               if isinstance(m, Linear) and path != "lm_head"}
    for name, param in model.named_parameters():
        path, _, leaf = name.rpartition(".")
        if path in linears:
            if leaf == "bias":
                tensors.update(_split_bias(path, linears[path], dtype))
            continue
        tensors[name] = param.detach().to(dtype).contiguous()
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return tensors


def _split_bias(path: str, linear: Linear, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    single = len(linear.out_sizes) == 1
    parts = linear.bias.detach().to(dtype).split(linear.out_sizes)
    return {checkpoint_name(path, "bias", None if single else i): p.contiguous()
            for i, p in enumerate(parts)}


def hf_config(source: ModelSource, quant_config: dict[str, Any]) -> dict[str, Any]:
    """The source's config.json with `quantization_config` and float16 as its dtype. Its
    nulls stay (Mistral's `sliding_window: null` is no window; left out, transformers and
    vLLM read their default of 4096)."""
    config = dict(source.hf_config)
    config.setdefault("model_type", MODEL_TYPES[source.config.architecture])
    config["torch_dtype"] = config["dtype"] = "float16"  # (transformers 4's name, and 5's)
    rope = config.get("rope_parameters")
    if "rope_theta" not in config and isinstance(rope, dict) and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]  # transformers 4 reads only this one
    config["quantization_config"] = quant_config
    return config


def write_checkpoint(out: Path, source: ModelSource, tensors: dict[str, torch.Tensor],
                     quant_config: dict[str, Any]) -> None:
    """Write the folder; `out` must not exist yet or be empty."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(source, quant_config), indent=2))
    if source.path.is_dir():
        for name in _TOKENIZER_FILES:
            if (source.path / name).is_file():
                shutil.copy2(source.path / name, out / name)
    else:
        write_tokenizer(out, source.tokenizer)


def disk_size(path: Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
