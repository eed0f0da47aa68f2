"""Every field of a valid body of each API, replaced one at a time by values of the wrong
kind (and removed), against a real `pkv serve`: never a 5xx, every refusal an error object in
the API's own shape, nothing held afterwards. Content parts and items are typed loosely (a
list of objects whose fields pkv reads itself), which is where a wrong kind reached code that
did not expect it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from pkv.cli.bench.mutate import REMOVED, WRONG_KINDS, mutated, places
from pkv.tests.server.conftest import RunningServer
from pkv.tests.server.test_hardening import _blocks_idle
from pkv.tests.server.test_http import MODEL

_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {
        "model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0, "stop": ["x"],
        "logprobs": 1, "seed": 1, "logit_bias": {"1": 1}, "top_k": 5, "suffix": None,
        "stream_options": None, "response_format": {"type": "text"}},
    "/v1/chat/completions": {
        "model": MODEL, "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 2,
        "stop": "x", "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [_CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "schema": {"type": "object"}}}},
    "/v1/responses": {
        "model": MODEL, "max_output_tokens": 1, "temperature": 0, "instructions": "be brief",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "r"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": "auto", "store": False, "truncation": "auto",
        "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}}},
    "/v1/messages": {
        "model": MODEL, "max_tokens": 1, "temperature": 0, "stop_sequences": ["x"],
        "system": [{"type": "text", "text": "s"}],
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [
                         {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": "b"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                   "content": [{"type": "text", "text": "r"}]}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"}},
    "/v1/messages/count_tokens": {
        "model": MODEL, "system": "s", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
    "/tokenize": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
}


def _shaped(response: httpx.Response, path: str) -> bool:
    """An error in the API's own shape: Anthropic's on /v1/messages, else OpenAI's."""
    try:
        body = response.json()
    except ValueError:
        return False
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and isinstance(body["error"].get("message"), str)
    error = body.get("error") or {}
    return set(error) == {"message", "type", "param", "code"} and bool(error["message"])


@pytest.mark.parametrize("path", list(BODIES))
def test_no_field_of_the_wrong_kind_is_a_server_error(server: RunningServer, path: str) -> None:
    body = BODIES[path]
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as http:
        assert http.post(path, json=body).status_code == 200  # the valid body is served
        wrong = []
        for where in list(places(body)):
            for value in WRONG_KINDS:
                r = http.post(path, json=mutated(body, where, value))
                if r.status_code >= 500 or (r.status_code >= 400 and not _shaped(r, path)):
                    wrong.append((where, "removed" if value is REMOVED else value,
                                  r.status_code, r.text[:200]))
        assert not wrong, wrong
        assert http.post(path, json=body).status_code == 200  # and still is
    _blocks_idle(server)
