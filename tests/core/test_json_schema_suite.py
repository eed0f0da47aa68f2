"""JSON Schema as clients write it: one schema per keyword pkv enforces, each generation by
the bundled model validated (formats too); exact numeric ranges checked against brute force."""

from __future__ import annotations

import json
import random
import re
from decimal import Decimal

import jsonschema
import pytest

from pkv import LLM, SamplingParams
from pkv.core.number_ranges import integer_range, number_range
from pkv.core.structured_outputs import StructuredOutputsParams as SO

S = {"type": "string", "maxLength": 12}
SUITE = {
    "integer-wide": {"type": "integer", "minimum": 1, "maximum": 99999},
    "integer-min-only": {"type": "integer", "minimum": 1000},
    "integer-exclusive": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 7},
    "number-range": {"type": "number", "minimum": -1.5, "maximum": 2.25},
    "string-length": {"type": "string", "minLength": 3, "maxLength": 6},
    "string-pattern": {"type": "string", "pattern": "^[a-z]{2}-[0-9]{3}$"},
    "format-date": {"type": "string", "format": "date"},
    "format-time": {"type": "string", "format": "time"},
    "format-date-time": {"type": "string", "format": "date-time"},
    "format-uuid": {"type": "string", "format": "uuid"},
    "format-email": {"type": "string", "format": "email"},
    "enum": {"enum": ["red", 7, None, True]},
    "const": {"type": "object", "properties": {"v": {"const": "fixed"}}, "required": ["v"]},
    "anyOf": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, S]},
    "oneOf": {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
    "allOf-objects": {"allOf": [
        {"type": "object", "properties": {"a": S}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "integer", "minimum": 0,
                                                "maximum": 50}}, "required": ["b"]}]},
    "ref-defs": {"$defs": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
                 "type": "object", "properties": {"age": {"$ref": "#/$defs/age"}},
                 "required": ["age"]},
    "ref-recursive": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9},
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["v", "next"]}}, "$ref": "#/$defs/node"},
    "nullable": {"type": "object", "properties": {"x": {"type": ["string", "null"],
                                                        "maxLength": 8}}, "required": ["x"]},
    "additionalProperties-false": {"type": "object", "properties": {"a": S},
                                   "required": ["a"], "additionalProperties": False},
    "additionalProperties-schema": {"type": "object", "maxProperties": 3,
                                    "additionalProperties": {"type": "integer", "minimum": 0,
                                                             "maximum": 9}},
    "prefixItems": {"type": "array", "prefixItems": [S, {"type": "integer", "minimum": 1,
                                                         "maximum": 5}], "items": False},
    "minItems-maxItems": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                     "maximum": 99},
                          "minItems": 2, "maxItems": 3},
}
CHECK = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.mark.parametrize("backend", ["outlines"])
def test_every_keyword_of_the_suite_validates(smol_llm: LLM, backend: str) -> None:
    assert smol_llm.llm_engine.guided.name == backend
    names = list(SUITE)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=80,
                             structured_outputs=SO(json=SUITE[n])) for i, n in enumerate(names)]
    outs = smol_llm.generate(["Answer with JSON:"] * len(names), params)
    failures = {}
    for name, out in zip(names, outs):
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), SUITE[name],
                                format_checker=CHECK)
        except (ValueError, jsonschema.ValidationError) as exc:
            failures[name] = (out.outputs[0].text, str(exc)[:200])
    assert not failures, failures


def test_an_empty_range_is_refused(smol_llm: LLM) -> None:
    with pytest.raises(ValueError, match="no integer lies in"):
        smol_llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=SO(
            json={"type": "integer", "minimum": 5, "maximum": 4})))


@pytest.mark.parametrize("lo, hi", [(1, 99999), (None, 5), (-37, None), (-1000, -7), (0, 0),
                                    (123, 45678), (-99, 99), (None, None), (10**12, None)])
def test_integer_ranges_are_exact(lo: int | None, hi: int | None) -> None:
    regex = re.compile(integer_range(lo, hi))
    rng = random.Random(0)
    values = [*range(-1100, 1100), *(rng.randint(-10**7, 10**7) for _ in range(2000)),
              *(v + d for v in (lo, hi) if v is not None for d in (-1, 0, 1))]
    for v in values:
        inside = (lo is None or v >= lo) and (hi is None or v <= hi)
        assert bool(regex.fullmatch(str(v))) == inside, v
    assert not any(regex.fullmatch(t) for t in ("01", "00", "+1", "1.0", "1e3"))


@pytest.mark.parametrize("lo, hi", [(-1.5, 2.5), (0.25, 0.75), (1, 100), (None, 3.14),
                                    (-2.05, None), (0.5, 0.5), (-100.125, -99.5), (3.1, 3.15),
                                    (12.34, 56.7)])
def test_number_ranges_are_exact(lo: float | None, hi: float | None) -> None:
    regex = re.compile(number_range(lo, hi))
    rng = random.Random(1)
    for _ in range(5000):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(0, 4)))
        text = f"{rng.choice(['', '-'])}{rng.randint(0, 120)}" + (f".{digits}" if digits else "")
        value = Decimal(text)
        inside = (lo is None or value >= Decimal(str(lo))) and \
            (hi is None or value <= Decimal(str(hi)))
        if text.startswith("-") and value == 0:
            continue  # "-0" is zero written oddly: the regex need not produce it
        assert bool(regex.fullmatch(text)) == inside, text
