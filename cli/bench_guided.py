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


def run_guided_bench(engine: Any, num_requests: int, batch: int, max_tokens: int,
                     console: Console) -> dict[str, Any]:
    import jsonschema

    from pkv.core.sampling_params import SamplingParams
    from pkv.core.structured_outputs import StructuredOutputsParams as SO

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
    table = Table(title="compile time per schema")
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
