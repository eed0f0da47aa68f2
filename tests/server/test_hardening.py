"""Hostile HTTP traffic against a real server: every route needs the key (but /health),
keys and templates never leak or run, and the engine serves the same canary afterwards
with every KV block back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute

from pkv.tests.server.conftest import API_KEY, RunningServer
from pkv.tests.server.test_http import MODEL, _assert_error, _post

CANARY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12,
          "temperature": 0}


def _canary(server: RunningServer) -> str:
    r = _post(server, "/v1/completions", CANARY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _blocks_idle(server: RunningServer) -> None:
    deadline = time.monotonic() + 10
    while True:
        m = server.metrics()
        idle = m["pkv:num_requests_running"] == 0
        if idle and m["pkv:kv_blocks_free"] == m["pkv:kv_blocks_total"]:
            return
        assert time.monotonic() < deadline, m
        time.sleep(0.2)


@pytest.fixture
def canary(server: RunningServer):  # noqa: ANN201 - yields nothing
    """The invariants of every negative test: same canary output, no held KV blocks."""
    before = _canary(server)
    yield
    assert _canary(server) == before
    _blocks_idle(server)


def _routes(tiny_llama_dir: Path) -> list[tuple[str, str]]:
    """(method, path) of every route of the app, read from its own route table."""
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.async_engine import AsyncLLM
    from pkv.core.engine.llm_engine import LLMEngine
    from pkv.core.server.api_server import ServerConfig, build_app

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="8MiB",
                                    max_model_len=64), show_progress=False)
    app = build_app(AsyncLLM(engine, 4), ServerConfig("m", api_key="k"))
    return sorted((method, route.path) for route in app.routes if isinstance(route, APIRoute)
                  for method in route.methods if method != "HEAD")


def test_every_route_but_health_needs_the_key(server: RunningServer, tiny_llama_dir: Path,
                                              canary: None) -> None:
    routes = _routes(tiny_llama_dir)
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/health") in routes
    wrong = ["", "Bearer", "Bearer wrong", "Bearer " + "x" * len(API_KEY),
             "Bearer " + API_KEY[:-1] + "4", "Basic " + API_KEY, API_KEY,
             "Bearer " + API_KEY + " extra", "Bearer  " + API_KEY, "bearer" + API_KEY,
             "Bearer " + API_KEY + "x" * 4096]
    for method, path in routes:
        for auth in wrong:
            headers = {"Authorization": auth} if auth else {}
            r = httpx.request(method, server.base_url + path, headers=headers, json={},
                              timeout=10)
            if path in ("/health", "/ping"):
                assert r.status_code == 200
                continue
            assert r.status_code == 401, (method, path, auth, r.status_code)
            assert API_KEY not in r.text and "Traceback" not in r.text
    assert API_KEY not in server.log()  # never logged
    for scheme in ("Bearer", "bearer", "BEARER"):  # a scheme's name has no case (RFC 9110)
        r = httpx.get(server.base_url + "/v1/models",
                      headers={"Authorization": f"{scheme} {API_KEY}"}, timeout=10)
        assert r.status_code == 200, scheme


@pytest.mark.parametrize("host", ["evil.example/../admin", "x?y=1", "a/b?c#d"])
def test_odd_host_headers_change_nothing(server: RunningServer, host: str,
                                         canary: None) -> None:
    r = httpx.get(f"{server.base_url}/v1/models", headers={"Host": host}, timeout=10)
    assert r.status_code == 401
    r = httpx.get(f"{server.base_url}/health", headers={"Host": host}, timeout=10)
    assert r.status_code == 200
    r = httpx.get(f"{server.base_url}/v1/models", headers={"Host": host, **server.headers},
                  timeout=10)
    assert r.status_code == 200


def test_logit_bias_steers_greedy_output(server: RunningServer, canary: None) -> None:
    forced = 1000  # an ordinary token id
    r = _post(server, "/v1/completions", {**CANARY, "max_tokens": 3,
                                          "logit_bias": {str(forced): 100}, "logprobs": 0})
    assert r.status_code == 200, r.text
    tokens = httpx.post(f"{server.base_url}/tokenize", headers=server.headers, timeout=10,
                        json={"prompt": r.json()["choices"][0]["text"],
                              "add_special_tokens": False}).json()["tokens"]
    assert set(tokens) == {forced}


def test_requests_cannot_supply_or_steer_chat_templates(server: RunningServer,
                                                        canary: None) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 2}
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    _assert_error(_post(server, "/v1/chat/completions", {**body, "chat_template": evil}),
                  400, "chat_template")
    for kwargs in ({"bos_token": "x"}, {"messages": []}, {"enable_thinking": "x" * 70000}):
        _assert_error(_post(server, "/v1/chat/completions",
                            {**body, "chat_template_kwargs": kwargs}),
                      400, "chat_template_kwargs")
    ok = _post(server, "/v1/chat/completions",
               {**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("body, content_type", [
    (b"[]", "application/json"), (b"null", "application/json"), (b'{"prompt": 5}',
                                                                  "application/json"),
    (b'{"model": "m", "prompt": "hi"}', "text/plain"), (b"\xff\xfe", "application/json"),
    (b'{"prompt": "' + b"a" * 100 + b'", "max_tokens": 1e400}', "application/json"),
])
def test_malformed_bodies_are_400s(server: RunningServer, body: bytes, content_type: str,
                                   canary: None) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", content=body, timeout=10,
                   headers={**server.headers, "content-type": content_type})
    assert r.status_code in (400, 415, 422), r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert len(r.content) < 4096 and "Traceback" not in r.text


@pytest.mark.parametrize("body, says", [
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests too deeply to parse"),
    (b'{"prompt": "caf\xe9"}', "not UTF-8 text"),
])
def test_unparsable_bodies_say_why(server: RunningServer, body: bytes, says: str,
                                   canary: None) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", content=body, timeout=10,
                   headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_oversized_headers_are_refused(server: RunningServer, canary: None) -> None:
    headers = {**server.headers, "X-Big": "a" * (128 * 1024)}
    try:
        r = httpx.get(f"{server.base_url}/v1/models", headers=headers, timeout=10)
        assert r.status_code in (400, 431)
    except httpx.TransportError:
        pass  # the server may just close the connection: also refused, with bounded memory


async def _storm(server: RunningServer, count: int) -> int:
    """`count` clients that give up after 0.5 s on requests that would run for minutes."""
    import asyncio

    body = {"model": MODEL, "prompt": "Tell me a very long story", "max_tokens": 900,
            "ignore_eos": True}
    timeouts = 0
    async with httpx.AsyncClient(timeout=0.5, headers=server.headers,
                                 limits=httpx.Limits(max_connections=count)) as client:
        async def one(i: int) -> bool:
            try:
                await client.post(f"{server.base_url}/v1/completions",
                                  json={**body, "stream": bool(i % 2)})
                return False
            except httpx.TimeoutException:
                return True
        timeouts = sum(await asyncio.gather(*(one(i) for i in range(count))))
    return timeouts


def test_a_storm_of_abandoned_requests_frees_everything(server: RunningServer,
                                                        canary: None) -> None:
    import asyncio

    before = _rss_without_kv(server)
    assert asyncio.run(_storm(server, 200)) >= 190
    start = time.monotonic()
    _blocks_idle(server)  # every abandoned request aborted, every block back
    r = _post(server, "/v1/completions", {**CANARY, "max_tokens": 4})
    assert r.status_code == 200 and time.monotonic() - start < 20
    # Memory comes back: the process outside its KV pool (which fills as blocks are first
    # used, up to its fixed size) stays near where it was before the storm.
    assert _rss_without_kv(server) < before + 96 * 2**20


def _rss_without_kv(server: RunningServer) -> float:
    """Once an idle server has handed its freed memory back (IDLE_RELEASE_SECONDS after its
    last step)."""
    import psutil

    from pkv.core.engine.async_engine import IDLE_RELEASE_SECONDS

    time.sleep(IDLE_RELEASE_SECONDS + 0.25)
    rss = psutil.Process(server.process.pid).memory_info().rss
    return rss - server.metrics()["pkv:kv_cache_resident_bytes"]


# Every number field's bounds are checked by one table in test_validation.py; these are the
# other fields a client can get wrong.
@pytest.mark.parametrize("field, value", [
    ("max_tokens", 10**12), ("stop", [""]),
    ("logit_bias", {"999999": 5}), ("logit_bias", {"-1": 5}), ("logit_bias", {"x": 1}),
    ("logit_bias", [1]), ("prompt", []), ("prompt", ["hi"] * 1000), ("prompt", None),
    ("cache_salt", "x" * 10000), ("cache_salt", "a\nb\x00"),
])
def test_parameter_bounds_are_400s_naming_the_field(server: RunningServer, field: str,
                                                     value: object, canary: None) -> None:
    import json

    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value}
    r = httpx.post(f"{server.base_url}/v1/completions", content=json.dumps(body), timeout=30,
                   headers={**server.headers, "content-type": "application/json"})
    error = _assert_error(r, 400)
    # A max_tokens past the context is OpenAI's context_length_exceeded, on the prompt.
    expected = "prompt" if (field, value) == ("max_tokens", 10**12) else field
    assert error["param"] == expected, (field, value, error)
    assert error["type"] == "invalid_request_error"


def test_a_dribbling_body_gets_408_and_holds_nothing(server: RunningServer, canary: None) -> None:
    import socket

    host, port = server.base_url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
            "Content-Length: 200\r\n\r\n").encode()
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + b'{"prompt": "hi", ')  # and then nothing more
        reply = b""
        while b"}}" not in reply:  # headers and body may come in separate segments
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 408"), reply[:200]
    assert "did not arrive within 2 s" in reply and time.monotonic() - start < 6


def test_dribbled_headers_and_silent_connections_are_closed(server: RunningServer,
                                                            canary: None) -> None:
    import socket

    host, port = server.base_url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as silent, \
            socket.create_connection((host, int(port)), timeout=10) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and no more
        assert silent.recv(4096) == b"" and slow.recv(4096) == b""  # closed by the server
    assert time.monotonic() - start < 6  # --body-timeout 2, not never
    # A kept-alive connection's next request has the same deadline from its first byte.
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        start = time.monotonic()
        assert sock.recv(4096) == b"" and time.monotonic() - start < 4


def test_a_chunked_body_over_the_limit_is_413(server: RunningServer, canary: None) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(6):
            yield b"x" * 2**20

    r = httpx.post(f"{server.base_url}/v1/completions", content=chunks(), timeout=30,
                   headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert "request body is over" in r.json()["error"]["message"]


async def _abandon(server: RunningServer, body: dict, count: int, timeout: float) -> int:
    """`count` requests whose clients give up after `timeout` s; returns how many did."""
    import asyncio

    async with httpx.AsyncClient(timeout=60, headers=server.headers) as client:
        async def one(i: int) -> bool:
            # A deadline on the whole exchange: a stream's chunks would reset a read timeout.
            try:
                await asyncio.wait_for(client.post(f"{server.base_url}/v1/completions",
                                                   json={**body, "stream": bool(i % 2)}), timeout)
            except asyncio.TimeoutError:
                return True
            return False
        return sum(await asyncio.gather(*(one(i) for i in range(count))))


@pytest.mark.parametrize("phase", ["grammar-compile", "n=4 decode"])
def test_clients_gone_in_any_phase_leave_nothing_behind(server: RunningServer, phase: str,
                                                        canary: None) -> None:
    import asyncio
    import uuid

    if phase == "grammar-compile":  # each constraint new (uncached), ~1.5 s to compile
        bodies = [{"model": MODEL, "prompt": "x", "max_tokens": 50,
                   "structured_outputs": {"regex": f"[a-z]{{1,{1500 + i}}}{uuid.uuid4().hex[:6]}"}}
                  for i in range(2)]
    else:
        bodies = [{"model": MODEL, "prompt": "Count:", "max_tokens": 400, "n": 4,
                   "ignore_eos": True, "temperature": 0.8}]
    gone = sum(asyncio.run(_abandon(server, body, 2, 0.4)) for body in bodies)
    assert gone == 2 * len(bodies)
    time.sleep(2 if phase == "grammar-compile" else 0)  # compiles finish, requests are dropped
    _blocks_idle(server)
