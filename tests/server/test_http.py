"""The server over raw HTTP: auth, limits and errors as OpenAI error objects, concurrency,
client disconnects, metrics, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from pkv.tests.server.conftest import RunningServer, start_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def _post(server: RunningServer, path: str, body: dict | bytes, **kw) -> httpx.Response:
    headers = {**server.headers, **kw.pop("headers", {})}
    if isinstance(body, bytes):
        return httpx.post(server.base_url + path, content=body, timeout=60,
                          headers={**headers, "content-type": "application/json"})
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)


def _assert_error(response: httpx.Response, status: int, param: str | None = None,
                  code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_health_version_and_metrics_names(server: RunningServer):
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # open without a key
    assert httpx.head(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/ping").status_code == 200  # vLLM's (SageMaker's)
    assert httpx.post(f"{server.base_url}/ping").status_code == 200
    _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                      "ignore_eos": True})
    assert httpx.get(f"{server.base_url}/version", headers=server.headers).json()["version"]
    names = set(server.metrics())
    for name in ("pkv:num_requests_running", "pkv:num_requests_waiting",
                 "pkv:kv_cache_usage_perc", "pkv:kv_blocks_total", "pkv:kv_blocks_free",
                 "pkv:num_preemptions_total", "pkv:prompt_tokens_total",
                 "pkv:generation_tokens_total", "pkv:prefix_cache_queries_total",
                 "pkv:prefix_cache_hits_total"):
        assert name in names, name
    metrics = server.metrics()  # a step's gap each (3 after the first token), a mean each
    assert metrics["pkv:inter_token_latency_seconds_count"] >= 3
    assert metrics["pkv:request_time_per_output_token_seconds_count"] >= 1
    assert 'le="7680.0"' in httpx.get(f"{server.base_url}/metrics", headers=server.headers).text
    text = httpx.get(f"{server.base_url}/metrics", headers=server.headers).text
    # The KV cache's storage: float32 rows of SmolLM2's 30 layers x 3 KV heads x 64.
    assert ('pkv:kv_cache_info{block_size="16",bytes_per_block="737280",dtype="float32"} 1.0'
            in text), text


def test_every_answer_carries_a_request_id(server: RunningServer, client):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    ok, unauthorized = _post(server, "/v1/completions", body), httpx.post(
        f"{server.base_url}/v1/completions", json=body)
    ids = [r.headers["x-request-id"] for r in (ok, unauthorized)]
    assert all(i.startswith("req_") for i in ids) and ids[0] != ids[1]
    assert ok.headers["request-id"] == ids[0]  # Anthropic's name for it
    # A caller's own id (a proxy's trace id) comes back; one that is not a token does not.
    traced = _post(server, "/v1/completions", body, headers={"X-Request-Id": "trace-42"})
    assert traced.headers["x-request-id"] == "trace-42"
    bad = _post(server, "/v1/completions", body, headers={"X-Request-Id": "a b"})
    assert bad.headers["x-request-id"].startswith("req_")
    # The openai client shows it on what it returns.
    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                           extra_headers={"X-Request-Id": "trace-43"})
    assert completion._request_id == "trace-43"


def test_auth_is_required_and_compared(server: RunningServer):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key-123"}):
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers)
        _assert_error(r, 401)
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(server.base_url + path).status_code == 401
    assert httpx.post(f"{server.base_url}/tokenize", json={"prompt": "x"}).status_code == 401


@pytest.mark.parametrize("body,status,param,code", [
    ({"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400, "prompt",
     "context_length_exceeded"),
    ({"model": MODEL, "prompt": "hi " * 1100, "max_tokens": 1}, 400, "prompt",
     "context_length_exceeded"),
    ({"model": MODEL, "prompt": "hi", "n": 17}, 400, "n", None),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    ({"model": MODEL, "prompt": "hi", "stop": ["x"] * 17}, 400, "stop", None),
    ({"model": MODEL, "prompt": "hi", "stop": ["x" * 300]}, 400, "stop", None),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ({"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
    ({"model": MODEL}, 400, "prompt", None),
    ({"model": MODEL, "prompt": "hi", "guided_json": {"type": "nonsense"}}, 400, "guided_json",
     None),
    ({"model": MODEL, "prompt": "hi", "guided_regex": "(x"}, 400, "guided_regex", None),
    ({"model": MODEL, "prompt": "hi", "guided_choice": []}, 400, "guided_choice", None),
    ({"model": MODEL, "prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, 400,
     "response_format", None),
    ({"model": MODEL, "prompt": "hi", "structured_outputs": {"json": {"type": "integer",
                                                                      "minimum": 5,
                                                                      "maximum": 4}}},
     400, "structured_outputs", None),
])
def test_completion_errors(server: RunningServer, body, status, param, code):
    _assert_error(_post(server, "/v1/completions", body), status, param, code)


def test_chat_errors(server: RunningServer):
    msgs = [{"role": "user", "content": "hi"}]
    _assert_error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400,
                  "messages")
    _assert_error(_post(server, "/v1/chat/completions",
                        {"model": MODEL, "messages": msgs, "logprobs": True,
                         "top_logprobs": 25}), 400, "top_logprobs")
    _assert_error(_post(server, "/v1/chat/completions",  # top_logprobs without logprobs
                        {"model": MODEL, "messages": msgs, "top_logprobs": 2}), 400,
                  "top_logprobs")
    _assert_error(_post(server, "/v1/chat/completions",
                        {"model": MODEL, "messages": msgs, "max_completion_tokens": 4000}),
                  400, "messages", "context_length_exceeded")
    bad_json = _assert_error(_post(server, "/v1/chat/completions", b"{not json"), 400)
    assert bad_json["message"].startswith("the request body is not valid JSON: ")
    assert bad_json["message"].endswith("(character 1)") and bad_json["param"] is None
    _assert_error(_post(server, "/v1/chat/completions", b"x" * (5 * 2**20)), 413)
    # curl -d without -H content-type: a form body; the message says what a body must be
    form = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                      content=b"model=x&messages=hi", headers={
                          **server.headers, "content-type": "application/x-www-form-urlencoded"})
    assert "application/json" in _assert_error(form, 400)["message"]
    empty = httpx.post(server.base_url + "/v1/chat/completions", headers=server.headers)
    assert "body is empty" in _assert_error(empty, 400)["message"]
    wrong_method = httpx.put(server.base_url + "/v1/chat/completions", headers=server.headers)
    assert _assert_error(wrong_method, 405)["type"] == "invalid_request_error"


def test_32_concurrent_streams_complete_with_correct_text(server: RunningServer):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(4)]
    expected = {p: _post(server, "/v1/completions", {"model": MODEL, "prompt": p,
                                                     "temperature": 0, "max_tokens": 20}
                         ).json()["choices"][0]["text"] for p in prompts}

    async def stream(prompt: str) -> str:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 20,
                    "stream": True}
            async with client.stream("POST", f"{server.base_url}/v1/completions", json=body,
                                     headers=server.headers) as r:
                assert r.status_code == 200
                text, done = "", False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        text += json.loads(line[6:])["choices"][0]["text"]
                assert done
                return text

    async def run_all() -> list[str]:
        return await asyncio.gather(*(stream(prompts[i % 4]) for i in range(32)))

    results = asyncio.run(run_all())
    assert results == [expected[prompts[i % 4]] for i in range(32)]


def test_dropped_stream_returns_its_blocks(server: RunningServer):
    idle = server.metrics()["pkv:kv_blocks_free"]
    body = {"model": MODEL, "prompt": "Write a very long story about dragons.",
            "max_tokens": 600, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      headers=server.headers, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break  # leave mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["pkv:num_requests_running"] == 0 and m["pkv:kv_blocks_free"] == idle:
            break
        time.sleep(0.2)
    m = server.metrics()
    assert m["pkv:num_requests_running"] == 0 and m["pkv:kv_blocks_free"] == idle
    assert m['pkv:request_success_total{finished_reason="abort"}'] >= 1


def test_queue_bound_and_sigterm_with_request_in_flight(tmp_path):
    server = start_server(str(tmp_path), "--max-num-seqs", "1", "--max-waiting-requests", "1",
                          "--shutdown-timeout", "30", api_key=None)
    try:
        body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 48,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                          timeout=60) as running:
            lines = running.iter_lines()
            next(lines)
            # One running, one waiting: the next one is refused before any byte is sent.
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                              timeout=60) as waiting:
                refused = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
                _assert_error(refused, 503)
                assert refused.headers["retry-after"]
                waiting.close()
            server.process.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest
                  if x.startswith("data: {")][-1]
        assert finish == "length"  # the in-flight request ran to its end
        assert server.process.wait(40) == 0
        assert "Traceback" not in server.log()
    finally:
        if server.process.poll() is None:
            server.process.kill()


def test_streams_still_running_at_the_grace_periods_end_get_an_error_event(tmp_path):
    server = start_server(str(tmp_path), "--shutdown-timeout", "1", api_key=None)
    try:
        long = {"model": MODEL, "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60,
                          json={**long, "prompt": "Tell me a story."}) as completion, \
                httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=60,
                             json={**long, "messages": [{"role": "user", "content": "Hi"}]}
                             ) as chat:
            lines = [completion.iter_lines(), chat.iter_lines()]
            for each in lines:
                assert next(each).startswith("data: {")
            server.process.send_signal(signal.SIGTERM)
            rests = [list(each) for each in lines]  # each read to its end: no cut chunk
        for rest in rests:
            errors = [json.loads(x[6:]) for x in rest if x.startswith('data: {"error"')]
            assert errors and "shutting down" in errors[0]["error"]["message"], rest[-3:]
            assert "data: [DONE]" in rest[-2:]
        assert server.process.wait(20) == 0
        log = server.log()
        assert "Traceback" not in log and "ending 2 requests still in flight" in log
    finally:
        if server.process.poll() is None:
            server.process.kill()


def test_admin_cache_needs_the_key_and_feeds_inspect_cache(server: RunningServer, tmp_path):
    from typer.testing import CliRunner

    from pkv.cli.main import app

    assert httpx.get(f"{server.base_url}/admin/cache").status_code == 401
    snap = httpx.get(f"{server.base_url}/admin/cache", headers=server.headers).json()
    assert snap["num_blocks"] == snap["used"] + snap["cached_free"] + snap["free"]
    assert len(snap["block_map"]) == snap["num_blocks"]
    result = CliRunner().invoke(app, ["inspect-cache", "--url", server.base_url,
                                      "--api-key", server.api_key])
    assert result.exit_code == 0 and "prefix hit rate" in result.output
