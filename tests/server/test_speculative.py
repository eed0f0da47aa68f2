"""`pkv serve --speculative-config`: streamed and plain answers equal the same server's
answers without speculation, and /metrics counts drafts over HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from pkv.tests.server.conftest import RunningServer, start_server, stop_server

COPY = ("Repeat the following text exactly.\n\nEvery block goes back to the pool when its "
        "request ends, and a cached block is reused by the next request with the same prefix."
        "\n\nRepeated text:\nEvery block")


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(str(tmp_path_factory.mktemp("spec")), "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 4}')
    yield running
    stop_server(running)


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                         max_retries=0, timeout=120)


def test_speculating_server_answers_as_the_plain_one(spec_server: RunningServer,
                                                     server: RunningServer):
    messages = [{"role": "user", "content": COPY}]
    plain = _client(server).chat.completions.create(
        model=_client(server).models.list().data[0].id, messages=messages, max_tokens=40,
        temperature=0)
    spec = _client(spec_server)
    model = spec.models.list().data[0].id
    before = spec_server.metrics()
    whole = spec.chat.completions.create(model=model, messages=messages, max_tokens=40,
                                         temperature=0)
    stream = spec.chat.completions.create(model=model, messages=messages, max_tokens=40,
                                          temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert whole.choices[0].message.content == plain.choices[0].message.content == streamed
    assert whole.usage.completion_tokens == plain.usage.completion_tokens
    after = spec_server.metrics()
    drafted = "pkv:spec_decode_num_draft_tokens_total"
    accepted = "pkv:spec_decode_num_accepted_tokens_total"
    assert after[drafted] > before[drafted]
    assert after[accepted] > before[accepted]
    assert after["pkv:kv_blocks_free"] == after["pkv:kv_blocks_total"]
