"""LoRA adapters in PEFT's format, read and checked against the model they will run on.

An adapter is a local folder or a Hugging Face id (`org/name`, cache first, as models are).

A folder holds `adapter_config.json` (peft_type LORA, r, lora_alpha, use_rslora, target
modules, optional per-module rank_pattern / alpha_pattern) and `adapter_model.safetensors`
(`...layers.3.self_attn.q_proj.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]). Pickled
`.bin` adapters are refused, as pickled checkpoints are.

Each LoRA'd projection lands on one of the model's linears: q/k/v on the fused `qkv_proj`
(shards 0/1/2), gate/up on `gate_up_proj`, o and down on themselves; a checkpoint that fuses
them itself (Phi-3) has one pair on `qkv_proj` whose B spans every shard. The scale
(alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B at load.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pkv.core.lora.layers import LoRATarget
from pkv.core.model_loader.hub import resolve_adapter
from pkv.core.models.base import STACKED

_PREFIX = "base_model.model."
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's names): a name clients use, a unique
    integer id, and the adapter's folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(frozen=True)
class LoRAWeight:
    """One projection's low-rank pair on one output shard of a linear: A [r, in] and
    B [out_shard, r] with the scale folded in."""

    shard: int
    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoRAAdapter:
    """A loaded adapter, per linear of the model (by module path)."""

    name: str
    path: str
    rank: int
    weights: dict[str, list[LoRAWeight]]
    uid: int = 0  # distinct for every load: prefix-cache blocks of two loads never mix
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size()
                          for ws in self.weights.values() for w in ws)


def load_adapter(name: str, path: str | Path, targets: dict[str, LoRATarget],
                 max_rank: int, uid: int) -> LoRAAdapter:
    """Read and check the adapter in `path` against the model's LoRA-able linears
    (`targets`, by module path); every problem is a one-line ValueError naming the adapter.
    `uid` tells this load apart from any other."""
    try:
        folder = resolve_adapter(str(path))
        config = _read_config(folder)
        tensors = _read_tensors(folder)
        weights, rank = _place(config, tensors, targets, max_rank)
    except (ValueError, FileNotFoundError) as exc:
        raise ValueError(f"LoRA adapter {name!r} ({path}): {exc}") from None
    return LoRAAdapter(name, str(path), rank, weights, uid)


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise ValueError("no such folder")
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise ValueError("no adapter_config.json (a PEFT LoRA adapter folder holds "
                         "adapter_config.json and adapter_model.safetensors)")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"adapter_config.json is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("adapter_config.json must hold an object")
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise ValueError(f"peft_type is {config.get('peft_type')!r}; only LORA adapters serve")
    # Each changes what the weights mean; served as plain LoRA, the output would be wrong.
    for key, what in (("use_dora", "DoRA adapters are not supported"),
                      ("fan_in_fan_out", "fan_in_fan_out (transposed, Conv1D) weights are not "
                                         "supported")):
        if config.get(key):
            raise ValueError(f"adapter_config.json sets {key}: {what}")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"adapter_config.json {key} must be a positive number, got "
                             f"{value!r}")
    return config


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        pickled = (folder / "adapter_model.bin").is_file()
        raise ValueError("adapter_model.bin is a pickle, which pkv never loads: save the "
                         "adapter with safe_serialization" if pickled
                         else "no adapter_model.safetensors")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"cannot read adapter_model.safetensors: {exc}") from None


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: a key matches a module path's end."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def _place(config: dict, tensors: dict[str, torch.Tensor], targets: dict[str, LoRATarget],
           max_rank: int) -> tuple[dict[str, list[LoRAWeight]], int]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"tensor {key!r} is not a LoRA A/B weight (embedding LoRA, "
                             "DoRA and modules_to_save are not supported)")
        module = key[:-len(suffix)].removeprefix(_PREFIX)
        pairs.setdefault(module, {})[suffix[1:7]] = tensor
    if not pairs:
        raise ValueError("adapter_model.safetensors holds no LoRA weights")
    weights: dict[str, list[LoRAWeight]] = {}
    top_rank = 0
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"{module} has only {', '.join(pair)}")
        a, b = pair["lora_A"].float(), pair["lora_B"].float()
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise ValueError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                             "are not a rank-r pair")
        if rank > max_rank:
            raise ValueError(f"{module} has rank {rank}, above max_lora_rank={max_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"{module} holds NaN or infinite values")
        alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        path, shard, linear = _target_for(targets, module)
        # A checkpoint's own fused projection (Phi-3's qkv_proj, gate_up_proj) as one pair:
        # B's rows cover every shard, each shard's with the one A.
        shards = range(len(linear.out_sizes)) if shard is None else [shard]
        out = sum(linear.out_sizes[s] for s in shards)
        if a.shape[1] != linear.in_features or b.shape[0] != out:
            raise ValueError(f"{module}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit the "
                             f"model's projection ({out} x {linear.in_features}); an adapter "
                             "for another base model?")
        rows = torch.split(b * scale, [linear.out_sizes[s] for s in shards])
        weights.setdefault(path, []).extend(LoRAWeight(s, a.contiguous(), part.contiguous())
                                            for s, part in zip(shards, rows))
        top_rank = max(top_rank, rank)
    return weights, top_rank


def _target_for(targets: dict[str, LoRATarget],
                module: str) -> tuple[str, int | None, LoRATarget]:
    """The model's linear (and fused shard) for a PEFT module path."""
    parent, _, leaf = module.rpartition(".")
    fused, shard = STACKED.get(leaf, (leaf, None))
    path = f"{parent}.{fused}" if parent else fused
    if path not in targets:
        raise ValueError(f"target module {module} is not a linear layer of this model's "
                         "decoder layers")
    return path, shard, targets[path]
