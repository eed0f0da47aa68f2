"""`pkv bench guided`: structured-output validity, compile times, and the cost of masking."""

from __future__ import annotations

import json
import time
from typing import Any

from rich.console import Console
from rich.table import Table

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "[a-z]{3,8}@[a-z]{3,8}\\.com"}},
        "required": ["name", "age", "email"]},
    "order": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "[A-Z]{3}-[0-9]{3}"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 20}},
            "required": ["sku", "qty"]}, "minItems": 1, "maxItems": 3},
        "express": {"type": "boolean"}}, "required": ["items", "express"]},
    "review": {"type": "object", "properties": {
        "stars": {"enum": [1, 2, 3, 4, 5]},
        "verdict": {"enum": ["buy", "skip", "wait"]},
        "summary": {"type": "string", "maxLength": 40}}, "required": ["stars", "verdict"]},
    "event": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24},
        "day": {"type": "string", "pattern": "2026-(0[1-9]|1[0-2])-[0-2][0-9]"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "maxItems": 3}}, "required": ["title", "day"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]},
                      "minItems": 1, "maxItems": 2}}, "required": ["id", "roles"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
}


_SHORT = {"type": "string", "maxLength": 12}
# One schema per JSON Schema keyword pkv enforces (README: Structured outputs).
KEYWORD_SUITE: dict[str, dict[str, Any]] = {
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
    "anyOf": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, _SHORT]},
    "oneOf": {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
    "allOf-objects": {"allOf": [
        {"type": "object", "properties": {"a": _SHORT}, "required": ["a"]},
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
    "additionalProperties-false": {"type": "object", "properties": {"a": _SHORT},
                                   "required": ["a"], "additionalProperties": False},
    "additionalProperties-schema": {"type": "object", "additionalProperties": {
        "type": "integer", "minimum": 0, "maximum": 9}},
    "prefixItems": {"type": "array", "prefixItems": [_SHORT, {"type": "integer", "minimum": 1,
                                                         "maximum": 5}], "items": False},
    "minItems-maxItems": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                     "maximum": 99},
                          "minItems": 2, "maxItems": 3},
}


def _keyword_suite(generate: Any, prompt: Any) -> int:
    """How many of the keyword suite's schemas the backend's outputs satisfy (formats too)."""
    import jsonschema

    from pkv.core.sample.sampling_params import SamplingParams
    from pkv.core.structured_output.params import StructuredOutputsParams as SO

    names = list(KEYWORD_SUITE)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=80,
                             structured_outputs=SO(json=KEYWORD_SUITE[n]))
              for i, n in enumerate(names)]
    outs, _ = generate(params, [prompt("JSON value") for _ in names])
    valid = 0
    for name, out in zip(names, outs):
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), KEYWORD_SUITE[name],
                                format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return valid


def mask_ms_per_step(engine: Any, outs: list, batch: int) -> float:
    """Milliseconds one decode step spends on guided decoding at `batch`: a mask and an
    advance for each of `batch` sequences, replaying generated outputs on fresh states."""
    from pkv.core.structured_output.params import StructuredOutputsParams as SO

    names = list(SCHEMAS)
    paths = [(SCHEMAS[names[i % len(names)]], outs[i % len(outs)].outputs[0].token_ids)
             for i in range(batch)]
    states = [engine.guided.compile(SO(json=schema)).new_state() for schema, _ in paths]
    steps = min(len(ids) for _, ids in paths)
    start = time.perf_counter()
    for t in range(steps):
        for state, (_, ids) in zip(states, paths):
            state.allowed_mask()
            state.advance(ids[t])
    return 1000 * (time.perf_counter() - start) / max(steps, 1)


def backends_table(results: dict[str, dict[str, Any]]) -> Table:
    """The backends side by side: coverage, validity, compile time, mask cost, throughput."""
    table = Table(title="guided decoding backends")
    for column in ("backend", "keyword suite valid", "outputs valid", "compile cold ms (mean)",
                   "compile cached ms", "mask ms/step b1", "mask ms/step b32",
                   "guided/unguided tok/s"):
        table.add_column(column, justify="right")
    for name, r in results.items():
        cold = [c["cold"] for c in r["compile_s"].values()]
        cached = [c["cached"] for c in r["compile_s"].values()]
        table.add_row(name, f"{r['suite_valid']}/{r['suite']}", f"{r['valid']}/{r['requests']}",
                      f"{1000 * sum(cold) / len(cold):.0f}",
                      f"{1000 * sum(cached) / len(cached):.3f}", f"{r['mask_ms']['1']:.2f}",
                      f"{r['mask_ms']['32']:.2f}", f"{r['ratio']:.2f}")
    return table


def run_guided_bench(engine: Any, num_requests: int, batch: int, max_tokens: int,
                     console: Console) -> dict[str, Any]:
    import jsonschema

    from pkv.core.sample.sampling_params import SamplingParams
    from pkv.core.structured_output.params import StructuredOutputsParams as SO

    tokenizer = engine.tokenizer
    compile_times = {}
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        engine.guided.compile(SO(json=schema))
        cold = time.perf_counter() - start
        start = time.perf_counter()
        engine.guided.compile(SO(json=schema))
        compile_times[name] = (cold, time.perf_counter() - start)
    names = list(SCHEMAS)
    prompt = lambda name: tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": f"Give a {name} as JSON."}]),
        add_special_tokens=False)

    def generate(params: list[SamplingParams], prompts: list[list[int]]) -> tuple[list, float]:
        ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        start = time.perf_counter()
        finals = {o.request_id: o for o in engine.generate_until_done()}
        return [finals[i] for i in ids], time.perf_counter() - start

    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens,
                             structured_outputs=SO(json=SCHEMAS[names[i % len(names)]]))
              for i in range(num_requests)]
    outs, _ = generate(params, [prompt(names[i % len(names)]) for i in range(num_requests)])
    valid = 0
    for i, out in enumerate(outs):
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[names[i % len(names)]])
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    prompts = [prompt(names[i % len(names)]) for i in range(batch)]
    guided, t_guided = generate(params[:batch], prompts)
    free_params = [SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens,
                                  ignore_eos=True) for i in range(batch)]
    free, t_free = generate(free_params, prompts)
    tokens = lambda outs: sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "valid": valid, "requests": num_requests,
        "compile_s": {n: {"cold": c, "cached": w} for n, (c, w) in compile_times.items()},
        "guided_output_throughput": tokens(guided) / t_guided,
        "unguided_output_throughput": tokens(free) / t_free,
    }
    result["ratio"] = result["guided_output_throughput"] / result["unguided_output_throughput"]
    result["suite_valid"], result["suite"] = _keyword_suite(generate, prompt), len(KEYWORD_SUITE)
    result["mask_ms"] = {str(b): mask_ms_per_step(engine, outs, b) for b in (1, 32)}
    table = Table(title=f"compile time per schema ({engine.guided.name})")
    for column in ("schema", "cold ms", "cached ms"):
        table.add_column(column, justify="left" if column == "schema" else "right")
    for name, (cold, cached) in compile_times.items():
        table.add_row(name, f"{1000 * cold:.1f}", f"{1000 * cached:.3f}")
    console.print(table)
    console.print(f"[bold]{valid}/{num_requests}[/] outputs parse and validate; batch {batch}: "
                  f"guided {result['guided_output_throughput']:.1f} tok/s, unguided "
                  f"{result['unguided_output_throughput']:.1f} tok/s, ratio "
                  f"{result['ratio']:.2f}")
    return result
