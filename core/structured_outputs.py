"""StructuredOutputsParams: what a request's output must match (vLLM's current names)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: a JSON schema, any JSON object, a regex, or a list of choices."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name, value in (("json", self.json), ("regex", self.regex),
                                          ("choice", self.choice),
                                          ("json_object", self.json_object or None))
                 if value is not None]
        if len(given) != 1:
            raise ValueError("structured outputs: give exactly one of json, regex, choice, "
                             f"json_object (got {', '.join(given) or 'none'})")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured outputs: choice must be a non-empty list of "
                                 "non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured outputs: json is not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured outputs: json must be a JSON schema object")
        if self.regex is not None and not self.regex:
            raise ValueError("structured outputs: regex must not be empty")

    @property
    def kind(self) -> str:
        if self.json is not None:
            return "json"
        if self.regex is not None:
            return "regex"
        return "choice" if self.choice is not None else "json_object"

    @property
    def key(self) -> tuple[str, str]:
        """A hashable identity for compiled-grammar caches."""
        spec = {"json": lambda: json.dumps(self.json, sort_keys=True),
                "regex": lambda: self.regex, "choice": lambda: json.dumps(list(self.choice)),
                "json_object": lambda: ""}[self.kind]()
        return self.kind, spec or ""
