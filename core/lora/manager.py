"""LoRAManager: the adapters a server knows by name, loaded once, checked against the model.

Adapters come from `--lora-modules` at start, from a request's `LoRARequest(name, id, path)`
the first time it is seen, or at runtime (`/v1/load_lora_adapter`). A request holds on to the
adapter object it was admitted with, so unloading a name never pulls weights from under a
request in flight; slots (core/lora/slots.py) are keyed by each load's uid.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from pkv.core.lora.adapter import LoRAAdapter, LoRARequest, load_adapter
from pkv.core.lora.layers import LoRATarget


def parse_lora_modules(items: list[str]) -> list[tuple[str, str]]:
    """`--lora-modules NAME=PATH` items as (name, path) pairs."""
    pairs = []
    for item in items:
        name, sep, path = str(item).partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {item!r}")
        pairs.append((name, path))
    return pairs


class LoRAManager:
    """Named adapters for one model."""

    def __init__(self, targets: dict[str, LoRATarget], max_rank: int) -> None:
        self.targets = targets
        self.max_rank = max_rank
        self.adapters: dict[str, LoRAAdapter] = {}
        self._uids = itertools.count(1)

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Load and register `path` as `name`; one-line ValueError on any problem."""
        if not name or not isinstance(name, str):
            raise ValueError("a LoRA adapter needs a non-empty name")
        if name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (from "
                             f"{self.adapters[name].path})")
        adapter = load_adapter(name, path, self.targets, self.max_rank, next(self._uids))
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        del self.adapters[name]

    def resolve(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter a request names, loaded on first sight."""
        adapter = self.adapters.get(request.lora_name)
        if adapter is None:
            return self.load(request.lora_name, request.lora_path)
        if _resolved(adapter.path) != _resolved(request.lora_path):
            raise ValueError(f"LoRA adapter {request.lora_name!r} is loaded from "
                             f"{adapter.path}, not {request.lora_path}")
        return adapter


def _resolved(path: str | Path) -> Path:
    return Path(path).expanduser().resolve()
