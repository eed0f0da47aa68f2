"""Guided decoding on the bundled model: outputs parse and validate, batches mix freely."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
import torch

from pkv import LLM, SamplingParams
from pkv.core.structured_output.params import ConstraintCompilerBusyError
from pkv.core.structured_output.params import StructuredOutputsParams as SO

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "zip": {"type": "string", "pattern": "[0-9]{5}"}}, "required": ["city", "zip"]}},
        "required": ["name", "address"]},
    "array-enum": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                   "minItems": 1, "maxItems": 3},
        "size": {"enum": ["S", "M", "L"]}}, "required": ["colors", "size"]},
    "bounded-int": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["age", "score"]},
    "optional": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 20},
        "done": {"type": "boolean"}, "note": {"type": "string", "maxLength": 8}},
        "required": ["title"]},
}
PROMPT = "Describe a person as JSON:"


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_outputs_validate(smol_llm: LLM, name: str, temperature: float):
    schema = SCHEMAS[name]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=120,
                            structured_outputs=SO(json=schema))
    outs = smol_llm.generate([PROMPT, "Give me data:"], params)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_a_finished_grammar_ends_even_under_min_tokens(smol_llm: LLM):
    """Once the constraint is complete only EOS fits it: min_tokens (which bans EOS) gives way
    rather than leave no token to sample (token 0, outside the grammar)."""
    params = SamplingParams(temperature=0, max_tokens=15, min_tokens=8,
                            structured_outputs=SO(choice=["alpha", "beta"]))
    out = smol_llm.generate("Pick one:", params)[0].outputs[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
    assert 0 not in out.token_ids and len(out.token_ids) < 8


def test_json_object_regex_and_choice(smol_llm: LLM):
    obj = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=80,
                                                   structured_outputs=SO(json_object=True)))
    assert isinstance(json.loads(obj[0].outputs[0].text), dict)
    regex = r"(yes|no), [0-9]{3}-[a-z]{2,4}"
    out = smol_llm.generate("Answer:", SamplingParams(temperature=0.7, seed=1, max_tokens=30,
                                                      structured_outputs=SO(regex=regex)))
    assert re.fullmatch(regex, out[0].outputs[0].text)
    choices = ["Paris", "London", "Berlin (DE)"]
    out = smol_llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=10, structured_outputs=SO(choice=choices)))
    assert out[0].outputs[0].text == "Paris"


def test_max_tokens_cut_reports_length(smol_llm: LLM):
    out = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3,
                                                   structured_outputs=SO(json=SCHEMAS["nested"])))
    assert out[0].outputs[0].finish_reason == "length"


def test_constrained_and_free_requests_share_a_batch(smol_llm: LLM):
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = smol_llm.generate(PROMPT, free)[0].outputs[0].token_ids
    guided = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=SO(choice=["alpha", "beta"]))
    mixed = smol_llm.generate([PROMPT, PROMPT, "x"], [free, guided, guided])
    assert mixed[0].outputs[0].token_ids == alone
    assert mixed[1].outputs[0].text in ("alpha", "beta")
    assert mixed[2].outputs[0].text in ("alpha", "beta")


def test_n_samples_each_follow_the_grammar(smol_llm: LLM):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=60,
                            structured_outputs=SO(json=SCHEMAS["array-enum"]))
    out = smol_llm.generate(PROMPT, params)[0]
    for completion in out.outputs:
        jsonschema.validate(json.loads(completion.text), SCHEMAS["array-enum"])


@pytest.mark.parametrize("kwargs,message", [
    ({"json": {"type": "nonsense"}}, "not a valid JSON Schema"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 4}}, "no integer lies in"),
    ({"regex": "(unclosed"}, "invalid regex constraint"),
])
def test_bad_constraints_raise_and_engine_goes_on(smol_llm: LLM, kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        smol_llm.generate(PROMPT, SamplingParams(structured_outputs=SO(**kwargs)))
    assert not smol_llm.llm_engine.has_unfinished_requests()
    assert smol_llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2))[0].outputs


@pytest.mark.parametrize("kwargs", [{"choice": []}, {"json": {}, "regex": "a"}, {}])
def test_bad_structured_params(kwargs: dict):
    with pytest.raises(ValueError, match="structured outputs"):
        SO(**kwargs)


def test_compile_time_limit_and_cache(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), kv_cache_memory="8MiB", show_progress=False,
              structured_outputs_timeout=1e-4)
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 30}
                                            for i in range(12)}}
    with pytest.raises(ValueError, match="took longer than"):
        llm.generate("x", SamplingParams(structured_outputs=SO(json=big)))
    backend = llm.llm_engine.guided
    quick = SO(choice=["a", "b"])
    backend.timeout_s = 30
    first = backend.compile(quick)
    assert backend.is_cached(quick) and backend.compile(quick) is first


def test_a_runaway_constraint_does_not_block_the_next(smol_llm: LLM):
    """Compiles cannot be killed: a constraint past the time limit keeps running, but later
    constraints get a fresh worker, and runaway ones are capped."""
    backend = smol_llm.llm_engine.guided
    saved = backend.timeout_s
    backend.timeout_s = 0.2
    try:
        slow = [SO(regex=f"[a-z]{{1,{n}}}") for n in (1500, 1501, 1502)]  # ~1.5 s each
        with pytest.raises(ValueError, match="took longer than"):
            backend.compile(slow[0])
        backend.timeout_s = 1.0  # far less than the runaway compile still has to go
        assert backend.compile(SO(choice=["yes", "no"])) is not None  # not queued behind it
        backend.timeout_s = 0.2
        with pytest.raises(ValueError, match="took longer than"):
            backend.compile(slow[1])
        # Overload, not a bad request: the server answers it 503 with Retry-After.
        with pytest.raises(ConstraintCompilerBusyError, match="still busy"):
            backend.compile(slow[2])
        # The runaway compiles finish on their own (~1.5 s each on a quiet machine; wait for
        # them rather than for a fixed time, which a loaded CI machine overruns).
        deadline = time.monotonic() + 120
        while any(not f.done() for f in backend._abandoned) and time.monotonic() < deadline:
            time.sleep(0.1)
        backend.timeout_s = 30
        assert backend.compile(SO(choice=["up", "down"])) is not None
    finally:
        backend.timeout_s = saved


def test_a_constraint_queued_behind_a_runaway_one_compiles(smol_llm: LLM):
    """One worker compiles: a constraint that arrives while a runaway one runs waits behind
    it, and is compiled by the fresh worker once that one is abandoned (it timed out with
    it before, and stayed pending, timing out every retry of the same constraint)."""
    backend = smol_llm.llm_engine.guided
    saved = backend.timeout_s
    backend.timeout_s = 0.5
    slow = SO(regex="[a-z]{1,1700}")  # ~1.5 s or more
    outcome: dict[str, BaseException] = {}

    def compile_slow() -> None:
        try:
            backend.compile(slow)
        except ValueError as exc:
            outcome["slow"] = exc

    try:
        runaway = threading.Thread(target=compile_slow)
        runaway.start()
        time.sleep(0.1)  # it runs; the next one queues behind it
        assert backend.compile(SO(choice=["left", "right"])) is not None
        runaway.join()
        assert "took longer than" in str(outcome["slow"])
        with pytest.raises(ValueError, match="still running"):  # at once, not after a wait
            backend.compile(slow)
        deadline = time.monotonic() + 120
        while any(not f.done() for f in backend._abandoned) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        backend.timeout_s = saved


def test_grammar_and_mask_caches_are_bounded_in_entries_and_bytes(tiny_llama_dir):
    """Many unique constraints, each walked through many states: the grammar cache keeps
    `cache_size` entries and all their token masks together stay within the byte budget."""
    from pkv.plugins.guided.outlines_backend import OutlinesBackend

    llm = LLM(str(tiny_llama_dir), kv_cache_memory="8MiB", show_progress=False)
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    backend = OutlinesBackend(engine.tokenizer, vocab, cache_size=4,
                              mask_cache_bytes=20 * vocab)  # room for 20 masks
    grammars = []
    for i in range(12):
        grammar = backend.compile(SO(regex=f"[a-c]{{{i + 3}}}x{i}"))
        grammars.append(grammar)
        state = grammar.new_state()
        for _ in range(i + 3):  # one mask per state on the way
            allowed = state.allowed_mask()
            state.advance(int(allowed.nonzero()[0]))
        assert backend.masks.nbytes <= 20 * vocab
    assert len(backend._cache) == 4 and len(backend.masks) <= 20
    # An evicted mask is recomputed, identical; masks of two grammars never mix.
    first, last = grammars[0], grammars[-1]
    start = first.index.get_initial_state()
    assert torch.equal(first.mask(start), first.mask(start))
    assert first.uid != last.uid


def test_a_constraint_can_start_after_a_thinking_block(smol_llm: LLM):
    """With a reasoning parser, the grammar waits for "</think>": before it every token is
    allowed (no mask), after it the grammar's own masks apply from its start."""
    from pkv.core.structured_output.params import DelayedGuidedState

    engine = smol_llm.llm_engine
    grammar = engine.guided.compile(SO(choice=["yes", "no"]))
    marker = engine.tokenizer.encode("</think>", add_special_tokens=False)
    state = DelayedGuidedState(grammar.new_state(), marker)
    for token in engine.tokenizer.encode("I think so", add_special_tokens=False) + marker[:-1]:
        assert state.allowed_mask() is None
        state.advance(token)
    state.advance(marker[-1])
    allowed = state.allowed_mask()
    assert allowed is not None and torch.equal(allowed, grammar.new_state().allowed_mask())
    params = SamplingParams(max_tokens=3, structured_outputs=SO(choice=["yes", "no"],
                                                                starts_after="</think>"))
    assert params.structured_outputs.key == SO(choice=["yes", "no"]).key  # one compiled grammar


def test_bounds_hold_on_a_nullable_number():
    # OpenAI strict schemas spell an optional field ["integer", "null"]; outlines ignores
    # bounds itself, so the rewrite splits the types and bounds the number's branch
    from pkv.plugins.guided.outlines_backend import to_regex

    schema = {"type": "object", "required": ["n", "x"], "properties": {
        "n": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
        "x": {"type": ["null", "number"], "maximum": 2.5}}}
    regex = to_regex(SO(json=schema))
    for text, ok in (('{"n": 3, "x": 2.5}', True), ('{"n": null, "x": null}', True),
                     ('{"n": 7, "x": 1}', False), ('{"n": -1, "x": 1}', False),
                     ('{"n": 0, "x": 3}', False)):
        assert bool(re.fullmatch(regex, text)) == ok, text


def test_a_recursive_tree_schema_compiles_and_bounds_its_depth():
    # The recursion is cut a few levels down: there a node's children can only be empty
    from pkv.plugins.guided.outlines_backend import to_regex

    node = {"type": "object", "required": ["name", "children"], "additionalProperties": False,
            "properties": {"name": {"type": "string", "maxLength": 4},
                           "children": {"type": "array", "maxItems": 3,
                                        "items": {"$ref": "#/$defs/Node"}}}}
    regex = to_regex(SO(json={"$ref": "#/$defs/Node", "$defs": {"Node": node}}))
    leaf = '{"name": "a", "children": []}'
    assert re.fullmatch(regex, leaf)
    assert re.fullmatch(regex, '{"name": "r", "children": [%s, %s]}' % (leaf, leaf))
    assert not re.fullmatch(regex, '{"name": "r", "children": [%s, %s, %s, %s]}' % ((leaf,) * 4))
    deep = leaf
    for _ in range(12):
        deep = '{"name": "n", "children": [%s]}' % deep
    assert not re.fullmatch(regex, deep)


def test_an_email_may_have_capitals():
    from pkv.plugins.guided.outlines_backend import to_regex

    regex = to_regex(SO(json={"type": "string", "format": "email"}))
    assert re.fullmatch(regex, '"Jane.Doe@Example.COM"')
    assert not re.fullmatch(regex, '"jane@"') and not re.fullmatch(regex, '"a b@c.de"')
