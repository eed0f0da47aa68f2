"""Which weight format a model is in, and the plugin that loads it.

A weight-loader plugin (hook `pkv_weight_loaders`) names a quantization method or a file
format. It may read files of its own (`open`, e.g. GGUF) and gives the linear layers their
storage (`linear_method`). `--quantization auto` takes what the checkpoint says; any other
value must agree with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pkv.core.layers.linear import LinearMethod

if TYPE_CHECKING:
    from pkv.core.model_loader.loader import ModelSource
    from pkv.core.registry import PluginRegistry


class WeightLoader:
    """Base of weight-loader plugins: a checkpoint format and how its linears compute."""

    name = "abstract"
    # Set by loaders that can quantize a float checkpoint while loading it.
    quantizes_float_checkpoints = False

    def open(self, path: Path) -> ModelSource:
        """Read a model file of this format (only loaders with a `file_magic` do)."""
        raise NotImplementedError(f"the {self.name} loader does not read files itself")

    def linear_method(self, source: ModelSource, device: torch.device) -> LinearMethod | None:
        """The storage of the decoder's linear layers (None: plain float)."""
        return None


def resolve_weight_loader(requested: str | None, source: ModelSource,
                          registry: PluginRegistry) -> WeightLoader | None:
    """The loader for `source` given `--quantization` (auto/None: what the checkpoint says)."""
    detected = source.quantization
    available = ", ".join(sorted(registry.weight_loaders)) or "none"
    if requested in (None, "auto"):
        requested = detected
    elif requested == "none":
        if detected is not None:
            raise ValueError(f"--quantization none was asked for, but the checkpoint is "
                             f"{detected}-quantized ({_where(source)})")
        return None
    if requested is None:
        return None
    if requested not in registry.weight_loaders:
        what = "the checkpoint is quantized with" if requested == detected else "unknown"
        raise ValueError(f"{what} quantization method {requested!r}, which pkv cannot load; "
                         f"available: {available}")
    loader = registry.weight_loaders[requested].load()()
    if requested != detected and not (detected is None and loader.quantizes_float_checkpoints):
        found = f"{detected}-quantized" if detected else "not quantized"
        raise ValueError(f"--quantization {requested} does not match the checkpoint, which is "
                         f"{found} ({_where(source)})")
    return loader


def _where(source: ModelSource) -> str:
    if source.quantization == "gguf":
        return f"GGUF file {source.path.name}"
    return f"quantization_config in {source.path / 'config.json'}"


# Decoder formats with few enough bits that a float LM head dominates a batch-1 step.
_LOW_BIT_LOADERS = frozenset({"awq"})


def int8_lm_head(setting: str, loader: WeightLoader | None, device: torch.device) -> bool:
    """Whether the LM head is stored as int8 (`lm_head_quantization`)."""
    if setting == "int8" and device.type != "cpu":
        raise ValueError(f"lm_head_quantization=int8 is a CPU kernel; the device is {device}")
    if setting == "auto":
        return device.type == "cpu" and loader is not None and loader.name in _LOW_BIT_LOADERS
    return setting == "int8"
