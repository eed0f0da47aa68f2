"""Every field a client can get wrong is a 400 naming that field: one table over every number
field of both endpoints (a new field missing from it fails the test), hostile JSON schemas,
messages without content."""

from __future__ import annotations

import json
import time
import typing

import httpx
import pytest

from pkv.core.server.protocol import ChatCompletionRequest, CompletionRequest
from pkv.tests.server.conftest import RunningServer
from pkv.tests.server.test_hardening import _blocks_idle
from pkv.tests.server.test_http import MODEL, _assert_error

NAN, INF = float("nan"), float("inf")

# Bad values of every number field: out of range, not finite, and numbers sent as strings,
# floats and booleans for integers (the strict policy: see pkv/core/server/protocol.py).
COMMON: dict[str, list[object]] = {
    "max_tokens": [0, -1, 1.5, "16", True],
    "temperature": [-0.5, NAN, INF, -INF, "0.5"],
    "top_p": [0, 1.5, NAN, INF, "1"],
    "top_k": [-2, 1.5, "5", True],
    "min_p": [-0.1, 1.5, NAN, INF],
    "n": [0, 10**6, "1", 1.5, True],
    "seed": [2**64, -(2**63) - 1, "7", 1.5],
    "stop_token_ids": [[-1], [10**9], ["1"], [1.5]],
    "allowed_token_ids": [[-1], [10**9], ["1"], [1.5], []],
    "logit_bias": [{"5": 101}, {"5": NAN}, {"5": INF}, {"5": "1"}],
    "presence_penalty": [2.5, -2.5, NAN, INF, "0"],
    "frequency_penalty": [2.5, NAN, -INF],
    "repetition_penalty": [0, -1, NAN, INF, "1.1"],
    "min_tokens": [-1, 1.5, "2"],
    "truncate_prompt_tokens": [0, -2, 1.5, "3", True],
    "prompt_logprobs": [-1, 21, 1.5, "2", True],
}
BAD = {
    "/v1/completions": {**COMMON, "logprobs": [-1, 21, 1.5, "2", True],
                        "best_of": [2, 0, 1.5, "1", True],
                        "prompt": [[1.5], [-1], [10**9], [NAN]]},
    "/v1/chat/completions": {**COMMON, "max_completion_tokens": [0, -1, 1.5, "16"],
                             "top_logprobs": [-1, 21, 1.5, "2"],
                             "thinking_token_budget": [-1, 1.5, "8", True]},
}
# A valid value of every number field: strictness must not refuse what is right.
GOOD = {"max_tokens": 4, "temperature": 0, "top_p": 1, "top_k": 0, "min_p": 0.0, "n": 1,
        "seed": 2**63, "stop_token_ids": [2], "allowed_token_ids": [5, 6], "logit_bias": {"5": -1},
        "presence_penalty": 0,
        "frequency_penalty": 0.5, "repetition_penalty": 1, "min_tokens": 1}
BASE = {
    "/v1/completions": {"model": MODEL, "prompt": "Hello"},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
}
MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def _numeric(annotation: object) -> bool:
    """Whether an annotation holds an int or a float anywhere (bool is not a number)."""
    if annotation in (int, float):
        return True
    return any(_numeric(arg) for arg in typing.get_args(annotation))


def _send(server: RunningServer, path: str, body: dict) -> httpx.Response:
    # json.dumps writes NaN and Infinity as Python's JSON reader (and so the server) reads them.
    return httpx.post(f"{server.base_url}{path}", content=json.dumps(body), timeout=60,
                      headers={**server.headers, "content-type": "application/json"})


@pytest.mark.parametrize("path", list(BAD))
def test_every_number_field_is_checked_and_named(server: RunningServer, path: str) -> None:
    fields = {name for name, f in MODELS[path].model_fields.items() if _numeric(f.annotation)}
    assert fields == set(BAD[path]), "a number field without bad values in this table"
    extra = {"max_completion_tokens": 4, "top_logprobs": 2, "logprobs": True} if "chat" in path \
        else {"logprobs": 2, "prompt": [1, 2, 3]}
    ok = _send(server, path, {**BASE[path], **GOOD, **extra})
    assert ok.status_code == 200, ok.text
    wrong = []
    for field, values in BAD[path].items():
        for value in values:
            r = _send(server, path, {**BASE[path], "max_tokens": 2, field: value})
            error = r.json().get("error") or {}
            if (r.status_code != 400 or error.get("param") != field
                    or field not in error.get("message", "")):
                wrong.append((field, value, r.status_code, error.get("param"),
                              error.get("message")))
    assert not wrong, wrong
    _blocks_idle(server)


def test_stream_options_need_stream(server: RunningServer) -> None:
    for path in BASE:
        r = _send(server, path, {**BASE[path], "max_tokens": 2,
                                 "stream_options": {"include_usage": True}})
        _assert_error(r, 400, "stream_options")


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize("schema, says", [
    (_deep(300), "deeper than 64"),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}},
     "more than 2048"),
    # Under the size bounds, but 1500 optional properties make a regex of ~50 MB.
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1500)}},
     "too large to compile"),
    ({"type": "object", "required": 5}, "at required"),
    ({"type": "integer", "minimum": "x"}, "at minimum"),
    ({"type": "stsring"}, "at type"),
])
def test_hostile_schemas_are_400s(server: RunningServer, schema: dict, says: str) -> None:
    start = time.monotonic()
    r = _send(server, "/v1/chat/completions", {**BASE["/v1/chat/completions"], "max_tokens": 4,
                                               "response_format": _response_format(schema)})
    error = _assert_error(r, 400, "response_format")
    assert says in error["message"], error
    assert time.monotonic() - start < 20


def test_a_schema_just_inside_the_bounds_is_served(server: RunningServer) -> None:
    schema = _deep(31)  # 63 levels of objects
    r = _send(server, "/v1/chat/completions", {**BASE["/v1/chat/completions"], "max_tokens": 4,
                                               "response_format": _response_format(schema)})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user"}], "messages[1].content"),
    ([{"role": "assistant", "content": None}, {"role": "user", "content": "Hi"}],
     "messages[0].content"),
    ([{"role": "wizard", "content": "Hi"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    # pkv serves text: a part it cannot read is refused, not dropped from the question.
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text", "text": ["Hi"]}]}], "messages[0].content"),
])
def test_messages_need_content_and_a_role(server: RunningServer, messages: list,
                                          param: str) -> None:
    r = _send(server, "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                               "max_tokens": 2})
    _assert_error(r, 400, param)
    r = _send(server, "/tokenize", {"messages": messages})
    _assert_error(r, 400, param)


def test_completions_refuse_what_they_would_answer_differently(server: RunningServer) -> None:
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 2}
    _assert_error(_send(server, "/v1/completions", {**body, "suffix": "\n    return c"}), 400,
                  "suffix")
    _assert_error(_send(server, "/v1/completions", {**body, "n": 2, "best_of": 3}), 400,
                  "best_of")
    for served in ({"suffix": ""}, {"suffix": None}, {"n": 2, "best_of": 2}):
        assert _send(server, "/v1/completions", {**body, **served}).status_code == 200


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "guided_grammar", 'root ::= "yes" | "no"'),
    ("/v1/completions", "guided_grammar", 'root ::= "yes" | "no"'),
    ("/v1/chat/completions", "structural_tag", {"type": "structural_tag"}),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "length_penalty", 0.5),
    ("/v1/chat/completions", "return_tokens_as_token_ids", True),
    ("/v1/chat/completions", "logits_processors", ["mod.Processor"]),
    ("/v1/completions", "priority", 5),
    ("/v1/chat/completions", "echo", True),
])
def test_vllm_fields_pkv_does_not_serve_are_refused_not_ignored(
        server: RunningServer, path: str, field: str, value: object) -> None:
    # a client that sent one would otherwise believe it was applied (a grammar ignored is
    # free text under a 200)
    body = ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            if path.endswith("chat/completions") else
            {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    _assert_error(_send(server, path, {**body, field: value}), 400, field)
    # the values that ask nothing are served
    asks_nothing = {"length_penalty": 1, "priority": 0, "use_beam_search": False}
    if field in asks_nothing:
        assert _send(server, path, {**body, field: asks_nothing[field]}).status_code == 200


def test_an_assistant_message_with_tool_calls_needs_no_content(server: RunningServer) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = _send(server, "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                               "max_tokens": 2})
    assert r.status_code == 200, r.text


_NULLABLE_BASE = {
    **BASE,
    "/v1/responses": {"model": MODEL, "input": "Hi"},
    "/v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
}
_TEXT = {  # the answer's text in each endpoint's response
    "/v1/completions": lambda r: r["choices"][0]["text"],
    "/v1/chat/completions": lambda r: r["choices"][0]["message"]["content"],
    "/v1/responses": lambda r: r["output"][-1]["content"][0]["text"],
    "/v1/messages": lambda r: r["content"][0]["text"],
}


@pytest.mark.parametrize("path", list(_NULLABLE_BASE))
def test_null_takes_a_fields_default(server: RunningServer, path: str) -> None:
    # The SDKs type these fields optional and send null for "not given" (store=None).
    from pkv.core.server.anthropic_messages import MessagesRequest
    from pkv.core.server.responses_items import ResponsesRequest

    model = {**MODELS, "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest}[path]
    nulls = {info.alias or name: None for name, info in model.model_fields.items()
             if info.default is not None and not info.is_required()}
    assert {"stream", "n", "logprobs", "store", "parallel_tool_calls"} & set(nulls)
    limit = {"/v1/responses": "max_output_tokens"}.get(path, "max_tokens")
    body = {**_NULLABLE_BASE[path], limit: 4, "temperature": 0}
    plain = _send(server, path, body)
    nulled = _send(server, path, {**nulls, **body})
    assert plain.status_code == 200 and nulled.status_code == 200, nulled.text
    assert _TEXT[path](nulled.json()) == _TEXT[path](plain.json())


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": MODEL, "prompt": "x\ud800", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["\ud800"]}, "stop[0]"),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "x\ud800"}]}, "messages[0].content"),
    ("/tokenize", {"prompt": "x\ud800"}, "prompt"),
    ("/v1/responses", {"model": MODEL, "input": "x\ud800"}, "input"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "x\ud800"}]}, "messages[0].content"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(server: RunningServer, path: str,
                                                    body: dict, param: str) -> None:
    # JSON's "\ud800" escape decodes to a string no tokenizer encodes (it was a 500)
    response = _send(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "not valid Unicode" in error["message"]
