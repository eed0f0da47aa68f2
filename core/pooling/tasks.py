"""Which task a model serves: generating text, embeddings, or a cross-encoder's scores.

`auto` follows the checkpoint: an encoder or a decoder saved without its LM head embeds, a
sequence classifier scores, a causal LM with sentence-transformers' files beside it (or a
GGUF that names a pooling type) embeds, any other causal LM generates. A task the checkpoint
cannot serve is one error naming both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pkv.core.config.engine import TASKS
from pkv.core.models.config import ModelConfig
from pkv.core.models.registry import POOLING_TASKS
from pkv.core.pooling.pooler import Pooler, PoolerConfig, classifier_activation


def resolve_task(asked: str, config: ModelConfig, folder: Path | None) -> str:
    """generate, embed or classify (`score` is classify: vLLM's name for cross-encoders)."""
    arch = config.hf_architecture or config.architecture
    default = POOLING_TASKS.get(config.hf_architecture)
    if default is None:
        st_folder = folder is not None and (folder / "modules.json").is_file()
        default = "embed" if st_folder or config.hf.get("pooling_mode") else "generate"
    if asked not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {asked!r}")
    task = {"auto": default, "score": "classify"}.get(asked, asked)
    if (task == "classify") != (default == "classify"):
        what = "a sequence classifier" if default == "classify" else "not a sequence classifier"
        raise ValueError(f"task={asked} does not fit {arch}, which is {what} (it serves "
                         f"task={default})")
    if task == "generate" and default != "generate":
        raise ValueError(f"{arch} has no LM head: it computes embeddings (task=embed), not "
                         "text")
    return task


def build_pooler(task: str, config: ModelConfig, folder: Path | None, model: Any) -> Pooler:
    """The pooler of an embed or classify model (its classifier head included)."""
    if task == "classify":
        return Pooler(PoolerConfig("cls", False, activation=classifier_activation(config.hf)),
                      config.hidden_size, model.classify)
    default_mode = getattr(model, "default_pooling", "last")
    return Pooler(PoolerConfig.for_model(folder, default_mode, config.hf), config.hidden_size)
