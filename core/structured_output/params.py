"""StructuredOutputsParams: what a request's output must match (vLLM's current names)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class ConstraintCompilerBusyError(RuntimeError):
    """Constraints compiled before this one ran past their time limit and still occupy the
    compiler: the server is overloaded (a 503 to retry), not the request wrong."""


# Bounds on a JSON schema, checked before anything walks it recursively (the meta-schema
# validator, the regex builder): nesting past them would exhaust the stack, and a schema of
# thousands of parts would compile for minutes. OpenAI's own are lower (10 levels, 5000
# properties). Depth counts JSON objects and arrays: one schema level inside "properties"
# is two.
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_NODES = 2048  # objects and arrays in the whole schema


def check_json_schema(schema: dict[str, Any]) -> None:
    """ValueError unless `schema` is within the bounds above and valid under its JSON Schema
    draft's meta-schema (`$schema`, else 2020-12)."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    nodes = 0
    while stack:  # iterative: a deep schema must not reach a recursion limit here either
        node, depth = stack.pop()
        nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"structured outputs: the json schema nests deeper than "
                             f"{MAX_SCHEMA_DEPTH} levels of objects and arrays")
        if nodes > MAX_SCHEMA_NODES:
            raise ValueError(f"structured outputs: the json schema has more than "
                             f"{MAX_SCHEMA_NODES} objects and arrays")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    import jsonschema

    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the top level"
        raise ValueError(f"structured outputs: json is not a valid JSON Schema: {exc.message} "
                         f"(at {where})") from None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: a JSON schema, any JSON object, a regex, or a list of choices."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    json_object: bool = False
    # The constraint starts once the output contains this text (a reasoning model's
    # "</think>": the thinking before it is free); not part of the compiled grammar.
    starts_after: str | None = None

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
        if self.json is not None:
            check_json_schema(self.json)
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


class DelayedGuidedState:
    """A grammar state that lets every token through until the output ends with `marker`
    (token ids), then constrains what follows: structured output after a thinking block."""

    def __init__(self, inner: Any, marker: list[int]) -> None:
        self.inner = inner
        self.marker = marker
        self.recent: list[int] = []
        self.active = not marker

    def allowed_mask(self) -> Any:
        return self.inner.allowed_mask() if self.active else None

    def advance(self, token_id: int) -> None:
        if self.active:
            self.inner.advance(token_id)
            return
        self.recent = (self.recent + [token_id])[-len(self.marker):]
        self.active = self.recent == self.marker
