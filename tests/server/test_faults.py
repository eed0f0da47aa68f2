"""Engine faults over real HTTP (an in-process server on loopback, faults injected into its
real engine): a wedged step fails a stream with an error event then [DONE], a non-streaming
request with a 503 error object, and /health turns 503 while answering fast."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from pkv.core.config.engine import EngineConfig
from pkv.core.engine.async_engine import AsyncLLM
from pkv.core.engine.llm_engine import LLMEngine
from pkv.core.server.api_server import ServerConfig, build_app
from pkv.tests.server.conftest import free_port


@pytest.fixture
def wedging_server(tiny_llama_dir: Path) -> Iterator[tuple[str, LLMEngine]]:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory="8MiB"),
                       show_progress=False)
    llm = AsyncLLM(engine, step_timeout=0.5)
    app = build_app(llm, ServerConfig("tiny"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    llm.start()
    thread.start()
    base = f"http://127.0.0.1:{port}"
    while not _up(base):
        time.sleep(0.05)
    yield base, engine
    server.should_exit = True
    thread.join(10)
    llm.shutdown(timeout=6)


def _up(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _wedge(engine: LLMEngine) -> None:
    real = engine.step

    def wedged() -> list:
        time.sleep(5)  # e.g. a deadlocked collective
        return real()

    engine.step = wedged


def test_wedged_step_fails_streams_then_health_is_503(wedging_server: tuple[str, LLMEngine]):
    base, engine = wedging_server
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 40, "stream": True}
    events = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    _wedge(engine)
                    wedged_at = time.monotonic()
    # The watchdog (0.5 s), not the step's end (5 s after the wedge), failed it; timed from the
    # wedge, as a loaded CI machine can take seconds over the prefill before it.
    assert time.monotonic() - wedged_at < 4
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable" and "wedged" in error["message"]
    health = httpx.get(f"{base}/health", timeout=2)
    assert health.status_code == 503 and "wedged" in health.json()["error"]["message"]
    refused = httpx.post(f"{base}/v1/completions", json={**body, "stream": False}, timeout=5)
    assert refused.status_code == 503
    assert refused.json()["error"]["message"].startswith("the engine is not available")


def test_a_wedged_step_ends_a_responses_stream_with_its_error_event(
        wedging_server: tuple[str, LLMEngine]):
    # The official client parses the event as Responses' own `error` (type, code, message),
    # not as an unknown event typed by the error's kind.
    import openai

    base, engine = wedging_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    events = []
    for event in client.responses.create(model="tiny", input="hello", max_output_tokens=100,
                                         stream=True):
        events.append(event)
        if len(events) == 1:
            _wedge(engine)
    last = events[-1]
    assert isinstance(last, openai.types.responses.ResponseErrorEvent)
    assert last.type == "error" and last.code == "engine_unavailable"
    assert "wedged" in last.message
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_wedged_step_ends_a_messages_stream_with_anthropics_error(
        wedging_server: tuple[str, LLMEngine]):
    # Anthropic's error vocabulary in the stream too (an engine that cannot serve: overloaded),
    # as a request refused before its stream began would say.
    import anthropic

    base, engine = wedging_server
    client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    events = []
    with pytest.raises(anthropic.APIStatusError) as failed:
        for event in client.messages.create(model="tiny", max_tokens=100, stream=True,
                                            messages=[{"role": "user", "content": "hello"}]):
            events.append(event)
            if len(events) == 1:
                _wedge(engine)
    assert events[0].type == "message_start"
    error = failed.value.body
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
    assert "wedged" in error["error"]["message"]


def test_pkv_serve_exits_non_zero_once_its_engine_is_dead(tmp_path: Path):
    """A step past --step-timeout wedges the engine for good: after a few seconds of 503s
    the process exits 1 with the reason, for compose's or systemd's restart to act on."""
    from pkv.tests.server.conftest import start_server, stop_server
    from pkv.tests.server.test_http import MODEL

    running = start_server(str(tmp_path), "--step-timeout", "0.001", "--log-level", "info",
                           api_key=None)
    try:
        r = httpx.post(f"{running.base_url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 8},
                       headers={"x-request-id": "ticket-4711"})
        assert r.status_code == 503
        # The access line names the client's id beside the engine request's (whose id the
        # engine's own lines about the failure name)
        line = next(x for x in running.log().splitlines() if "ticket-4711" in x)
        assert "POST /v1/completions 503" in line and " cmpl-" in line and "hello" not in line
        assert httpx.get(f"{running.base_url}/health", timeout=5).status_code == 503
        assert running.process.wait(timeout=30) == 1
        assert "error: the engine stopped" in running.log()
    finally:
        stop_server(running)
