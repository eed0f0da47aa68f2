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
from pkv.cli.bench.guided import KEYWORD_SUITE as SUITE
from pkv.core.structured_output.number_ranges import integer_range, number_range
from pkv.core.structured_output.params import StructuredOutputsParams as SO

CHECK = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module")
def xgrammar_llm() -> LLM:
    return LLM(kv_cache_memory="64MiB", max_model_len=512, show_progress=False,
               guided_decoding_backend="xgrammar")


@pytest.mark.parametrize("backend", ["outlines", "xgrammar"])
def test_every_keyword_of_the_suite_validates(request: pytest.FixtureRequest,
                                              backend: str) -> None:
    llm = request.getfixturevalue("smol_llm" if backend == "outlines" else "xgrammar_llm")
    assert llm.llm_engine.guided.name == backend
    names = list(SUITE)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=80,
                             structured_outputs=SO(json=SUITE[n])) for i, n in enumerate(names)]
    outs = llm.generate(["Answer with JSON:"] * len(names), params)
    # A sampled answer may wander into a string or a number that outlasts max_tokens (a
    # free-form key, an integer with no maximum): three of the 23 are allowed (two were, with
    # this seed and sampler); every answer that ended must validate.
    cut = [n for n, out in zip(names, outs) if out.outputs[0].finish_reason == "length"]
    assert len(cut) <= 3, cut
    failures = {}
    for name, out in zip(names, outs):
        if name in cut:
            continue
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


def test_xgrammar_regex_choice_and_object(xgrammar_llm: LLM) -> None:
    params = [SamplingParams(temperature=0, max_tokens=150, structured_outputs=so)
              for so in (SO(regex="[A-Z]{3}-[0-9]{4}"), SO(choice=["yes", "no", "maybe"]),
                         SO(json_object=True))]
    prompts = ["Code:", "Mood:", 'A JSON object with a "name": ']
    code, mood, obj = (o.outputs[0].text for o in xgrammar_llm.generate(prompts, params))
    assert re.fullmatch("[A-Z]{3}-[0-9]{4}", code) and mood in ("yes", "no", "maybe")
    assert isinstance(json.loads(obj), dict)


def test_auto_routes_each_kind_to_its_backend(xgrammar_llm: LLM) -> None:
    from pkv.plugins.guided.auto_backend import ROUTES, AutoBackend

    engine = xgrammar_llm.llm_engine
    auto = AutoBackend(engine.tokenizer, engine.model_config.vocab_size)
    for kind, so in {"json": SO(json={"type": "integer"}), "json_object": SO(json_object=True),
                     "regex": SO(regex="[0-9]+"), "choice": SO(choice=["a", "b"])}.items():
        assert auto.backend_for(so).name == ROUTES[kind]
        state = auto.compile(so).new_state()
        assert state.allowed_mask().any()
    auto.timeout_s = 5.0
    assert all(b.timeout_s == 5.0 for b in auto.backends.values())
