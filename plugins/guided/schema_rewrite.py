"""A JSON schema rewritten into what outlines-core compiles correctly.

outlines-core ignores numeric bounds, writes the objects of an allOf one after another, and
leaves a dangling comma where it stops unrolling a recursive $ref. So before it sees a schema:
a bounded integer or number becomes a placeholder constant whose quoted form is swapped
afterwards for an exact range regex (pkv.core.structured_output.number_ranges); an allOf of
objects becomes one object; $refs are inlined here, recursion at most MAX_REF_DEPTH levels
deep, past which the branch that recurses is dropped (an anyOf keeps its other branches, an
optional property goes); a date-time or email gets bounded parts. Schema depth is bounded
before this runs (check_json_schema), so the recursion here is too.
"""

from __future__ import annotations

import math
from typing import Any

from pkv.core.structured_output.number_ranges import integer_range, number_range

MAX_REF_DEPTH = 3  # a recursive $ref is unrolled this many levels
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Formats whose outlines-core regex lets a string run on without end (a year of any width,
# an email's unbounded parts): the same shapes with bounded parts.
FORMATS = {
    "date-time": (r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:"
                  r"[0-5]\d(\.\d{1,6})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"),
    "email": r"[A-Za-z0-9._%+-]{1,32}@[A-Za-z0-9-]{1,32}(\.[A-Za-z0-9-]{1,32}){0,3}"
             r"\.[A-Za-z]{2,8}",
}

NEVER: Any = object()  # a schema no value satisfies (where recursion was cut)


class SchemaRewriter:
    """`schema`: the rewritten schema; `numbers`: placeholder -> range regex (with `ranges`
    False, bounds stay in the schema: for a compiler that enforces them itself)."""

    def __init__(self, schema: dict[str, Any], ranges: bool = True) -> None:
        self.root = schema
        self.ranges = ranges
        self.numbers: dict[str, str] = {}
        rewritten = self._node(schema, {})
        if rewritten is NEVER:
            raise ValueError("the schema's recursion cannot end within "
                             f"{MAX_REF_DEPTH} levels")
        rewritten.pop("$defs", None)
        rewritten.pop("definitions", None)
        self.schema = rewritten

    def _node(self, node: Any, depth: dict[str, int]) -> Any:
        """The rewritten node; NEVER where it can never be satisfied (recursion cut)."""
        if not isinstance(node, dict):
            return node
        if isinstance(node.get("$ref"), str):
            return self._ref(node["$ref"], depth)
        out: dict[str, Any] = {}
        empty_only = False
        for key, value in node.items():
            if key in ("$defs", "definitions"):
                continue
            if key in ("anyOf", "oneOf") and isinstance(value, list):
                branches = [b for b in (self._node(v, depth) for v in value) if b is not NEVER]
                if not branches:
                    return NEVER
                out[key] = branches
            elif key == "properties" and isinstance(value, dict):
                props = {k: self._node(v, depth) for k, v in value.items()}
                if any(props[r] is NEVER for r in node.get("required", []) if r in props):
                    return NEVER
                out[key] = {k: v for k, v in props.items() if v is not NEVER}
            elif isinstance(value, dict):
                sub = self._node(value, depth)
                if sub is NEVER and key == "items":  # (outlines takes no `items: false`)
                    if node.get("minItems", 0) > 0:
                        return NEVER
                    empty_only = True  # an empty array is all that is left
                    continue
                if sub is NEVER:
                    if key != "additionalProperties":
                        return NEVER
                    sub = False
                out[key] = sub
            elif isinstance(value, list):
                subs = [self._node(v, depth) for v in value]
                if any(v is NEVER for v in subs):
                    return NEVER
                out[key] = subs
            else:
                out[key] = value
        if empty_only:
            out["maxItems"] = 0
        return self._special(out)

    def _ref(self, ref: str, depth: dict[str, int]) -> Any:
        if depth.get(ref, 0) >= MAX_REF_DEPTH:
            return NEVER
        target: Any = self.root
        for part in ref.removeprefix("#").strip("/").split("/") if ref != "#" else []:
            if not isinstance(target, dict) or part not in target:
                raise ValueError(f"$ref {ref!r} points nowhere in the schema (only local "
                                 "refs, #/$defs/NAME, are followed)")
            target = target[part]
        if not ref.startswith("#"):
            raise ValueError(f"$ref {ref!r} is not local; only #/$defs/NAME refs are followed")
        return self._node(target, {**depth, ref: depth.get(ref, 0) + 1})

    def _special(self, node: dict[str, Any]) -> dict[str, Any]:
        if isinstance(node.get("allOf"), list) and all(_is_object(s) for s in node["allOf"]):
            node = _merge_objects(node)
        if node.get("format") in FORMATS and node.get("type") == "string":
            pattern = FORMATS[node["format"]]
            node = {**{k: v for k, v in node.items() if k != "format"}, "pattern": pattern}
        kind = node.get("type")
        if (self.ranges and isinstance(kind, list) and any(b in node for b in BOUNDS)
                and any(k in ("integer", "number") for k in kind)):
            # ["integer", "null"] and the like: a branch a type, so that the bounds hold
            rest = {k: v for k, v in node.items() if k not in BOUNDS and k != "type"}
            return {"anyOf": [self._special({**node, "type": k}) if k in ("integer", "number")
                              else {**rest, "type": k} for k in kind]}
        if self.ranges and kind in ("integer", "number") and any(b in node for b in BOUNDS):
            key = f"PKVRANGE{len(self.numbers)}X"
            self.numbers[key] = _range_regex(kind, node)
            return {"const": key}
        return node


def _is_object(schema: Any) -> bool:
    return isinstance(schema, dict) and (schema.get("type") == "object"
                                         or "properties" in schema)


def _merge_objects(schema: dict[str, Any]) -> dict[str, Any]:
    parts = schema.pop("allOf")
    merged: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
    for part in [schema, *parts]:
        merged["properties"].update(part.get("properties", {}))
        merged["required"] += [r for r in part.get("required", [])
                               if r not in merged["required"]]
        if "additionalProperties" in part:
            merged["additionalProperties"] = part["additionalProperties"]
    return merged


def _range_regex(kind: str, schema: dict[str, Any]) -> str:
    """Exact for integers; for numbers, exclusive bounds are enforced as inclusive."""
    lo, hi = schema.get("minimum"), schema.get("maximum")
    xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if kind == "integer":
        lows = [math.ceil(lo)] if lo is not None else []
        highs = [math.floor(hi)] if hi is not None else []
        lows += [math.floor(xlo) + 1] if xlo is not None else []
        highs += [math.ceil(xhi) - 1] if xhi is not None else []
        return integer_range(max(lows, default=None), min(highs, default=None))
    lows = [v for v in (lo, xlo) if v is not None]
    highs = [v for v in (hi, xhi) if v is not None]
    return number_range(max(lows, default=None), min(highs, default=None))
