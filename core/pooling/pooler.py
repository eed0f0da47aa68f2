"""The pooler: one vector per prompt from its hidden states.

How a checkpoint pools is read from sentence-transformers' files beside it: `modules.json`
names the modules after the transformer (Pooling, Normalize), `1_Pooling/config.json` the
pooling mode. Without them: CLS for BERT encoders, the last token for decoders (whose last
position is the only one that has seen the whole prompt), normalized either way.

A classifier (a cross-encoder) pools its CLS row and runs its head on it (`head`); its
logits become scores through the classifier's activation: the one its config names, else
sigmoid for one label and softmax for several (what sentence-transformers' CrossEncoder
returns).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pkv.core.pooling.params import PoolingParams

POOLING_MODES = ("cls", "mean", "last")
# 1_Pooling/config.json's flags and the mode each turns on
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_lasttoken": "last"}
_ST_MODULE = "sentence_transformers.models."


@dataclass(frozen=True)
class PoolerConfig:
    """How a model pools: `mode`, whether it normalizes, which Matryoshka sizes it allows
    (None: none; () any size up to the hidden size)."""

    mode: str
    normalize: bool
    matryoshka: tuple[int, ...] | None = None
    # a classifier's: "default" (sigmoid for one label, softmax for several), "sigmoid" or
    # "identity" (the logits), as its config names it
    activation: str = "default"

    @classmethod
    def for_model(cls, folder: Path | None, default_mode: str,
                  hf_config: dict[str, Any]) -> PoolerConfig:
        """Read sentence-transformers' modules beside the checkpoint (when `folder` has
        them), else the config's `pooling_mode` (a GGUF's pooling type) or `default_mode`,
        normalized."""
        mode, normalize = hf_config.get("pooling_mode", default_mode), True
        modules_file = folder / "modules.json" if folder is not None else None
        if modules_file is not None and modules_file.is_file():
            mode, normalize = _read_st_modules(folder, modules_file, default_mode)
        sizes = hf_config.get("matryoshka_dimensions")
        matryoshka = (tuple(int(s) for s in sizes) if isinstance(sizes, list)
                      else () if hf_config.get("is_matryoshka") else None)
        return cls(mode, normalize, matryoshka)


def _read_st_modules(folder: Path, modules_file: Path, default_mode: str) -> tuple[str, bool]:
    try:
        modules = json.loads(modules_file.read_text())
        kinds = [(m["type"], m.get("path", "")) for m in modules]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{modules_file} is not a sentence-transformers modules list: "
                         f"{exc}") from None
    mode, normalize = default_mode, False
    for kind, path in kinds:
        name = kind.removeprefix(_ST_MODULE)
        if name == "Transformer":
            continue
        if name == "Normalize":
            normalize = True
        elif name == "Pooling":
            mode = _read_st_pooling(folder / path / "config.json")
        else:
            raise ValueError(f"{modules_file} names the sentence-transformers module {kind!r}, "
                             "which pkv does not run (it runs Transformer, Pooling, Normalize)")
    return mode, normalize


def _read_st_pooling(path: Path) -> str:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the pooling config {path}: {exc}") from None
    on = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    unknown = [key for key in on if key not in _ST_MODES]
    if unknown or len(on) != 1:
        raise ValueError(f"{path} turns on {on or 'no pooling mode'}; pkv pools by exactly "
                         f"one of {', '.join(_ST_MODES)}")
    return _ST_MODES[on[0]]


class Pooler:
    """Pools a step's hidden states into one result per pooling request."""

    def __init__(self, config: PoolerConfig, hidden_size: int,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`head`: a classifier over the pooled rows (its logits are the result)."""
        self.config = config
        self.hidden_size = hidden_size
        self.head = head

    @property
    def classifies(self) -> bool:
        return self.head is not None

    @property
    def reads_last_row_only(self) -> bool:
        """Whether a prompt's vector comes from its last row alone (an embedding pooled on
        its last token): then its other rows may be cached or computed in earlier steps."""
        return self.config.mode == "last" and not self.classifies

    def check(self, params: PoolingParams) -> None:
        """Raise ValueError (starting with the field's name) for what this model cannot do."""
        dims = params.dimensions
        if dims is None:
            return
        if self.classifies:
            raise ValueError("dimensions applies to embeddings; this model is a classifier")
        allowed = self.config.matryoshka
        if allowed is None:
            raise ValueError("dimensions is not supported by this model (it is not trained "
                             "for Matryoshka truncation)")
        if not dims <= self.hidden_size or (allowed and dims not in allowed):
            sizes = ", ".join(map(str, allowed)) if allowed else f"1..{self.hidden_size}"
            raise ValueError(f"dimensions={dims} is not one this model offers ({sizes})")

    def __call__(self, hidden: torch.Tensor, spans: list[tuple[int, int]],
                 params: list[PoolingParams]) -> list[torch.Tensor]:
        """One float32 vector per (first row, row count) span of `hidden` [tokens, hidden]."""
        pooled = pool_rows(hidden, spans, self.config.mode)
        if self.head is not None:
            logits = self.head(pooled).float()
            return [_activate(row, self.config.activation if p.activation else "identity")
                    for row, p in zip(logits, params)]
        return [self._finish(row.float(), p) for row, p in zip(pooled, params)]

    def _finish(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        # A truncated Matryoshka vector is renormalized whatever the model says, unless the
        # request says normalize=False.
        normalize = (self.config.normalize or params.dimensions is not None
                     if params.normalize is None else params.normalize)
        if normalize:
            vector = F.normalize(vector, dim=-1)
        return vector


def pool_rows(hidden: torch.Tensor, spans: list[tuple[int, int]], mode: str) -> torch.Tensor:
    """[len(spans), hidden]: each span's first row (cls), last row (last) or mean (mean)."""
    if mode == "cls":
        return hidden[[start for start, _ in spans]]
    if mode == "last":
        return hidden[[start + n - 1 for start, n in spans]]
    if mode == "mean":
        return torch.stack([hidden[start:start + n].mean(0) for start, n in spans])
    raise ValueError(f"pooling mode {mode!r} is not one of {', '.join(POOLING_MODES)}")


def _activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "identity":
        return logits
    if activation == "sigmoid" or logits.numel() == 1:
        return torch.sigmoid(logits)
    return torch.softmax(logits, -1)


def classifier_activation(hf_config: dict[str, Any]) -> str:
    """What a cross-encoder's scores go through, as sentence-transformers reads its config
    (`sentence_transformers.activation_fn`, or the older `sbert_ce_default_activation_
    function`): ms-marco-MiniLM's Identity returns the logits themselves."""
    named = ((hf_config.get("sentence_transformers") or {}).get("activation_fn")
             or hf_config.get("sbert_ce_default_activation_function"))
    tail = named.rsplit(".", 1)[-1] if isinstance(named, str) else ""
    return {"Identity": "identity", "Sigmoid": "sigmoid"}.get(tail, "default")
