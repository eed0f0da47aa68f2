"""Reasoning budgets over HTTP: `thinking_token_budget` (and `reasoning_effort`'s budget)
ends the thinking block where it says, streamed and non-streamed agree, and Anthropic's
`thinking.budget_tokens` does the same; a budget without a reasoning parser is a 400."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from pkv.tests.server.conftest import RunningServer, start_server, stop_server
from pkv.tests.server.test_http import MODEL, _assert_error, _post

ASK = [{"role": "user", "content": "How many legs do three spiders have?"}]


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # DeepSeek-R1's parser: the output is thinking until </think> (the template opened it).
    running = start_server(str(tmp_path_factory.mktemp("thinking")), "--reasoning-parser",
                           "deepseek_r1")
    yield running
    stop_server(running)


def test_the_budget_ends_thinking_streamed_or_not(thinking_server: RunningServer):
    client = openai.OpenAI(base_url=f"{thinking_server.base_url}/v1",
                           api_key=thinking_server.api_key, max_retries=0, timeout=120)
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=24)
    free = client.chat.completions.create(**kw).choices[0].message
    assert free.content in (None, "")  # the model never closes the block on its own
    capped = client.chat.completions.create(**kw, extra_body={"thinking_token_budget": 6})
    message = capped.choices[0].message
    assert message.reasoning_content and message.content
    assert free.reasoning_content.startswith(message.reasoning_content)
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True,
                                                extra_body={"thinking_token_budget": 6}):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)
    low = client.chat.completions.create(**kw, reasoning_effort="low").choices[0].message
    assert low.content in (None, "")  # 512 thinking tokens: more than this answer has

    response = _post(thinking_server, "/v1/messages", {
        "model": MODEL, "max_tokens": 24, "messages": ASK, "temperature": 0,
        "thinking": {"type": "enabled", "budget_tokens": 6}})
    assert response.status_code == 200, response.text
    blocks = response.json()["content"]
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert (blocks[0]["thinking"], blocks[1]["text"]) == (message.reasoning_content,
                                                          message.content)


def test_no_budget_where_the_template_was_told_not_to_think(thinking_server: RunningServer):
    # The output is then the answer: the budget's end marker would land in it.
    client = openai.OpenAI(base_url=f"{thinking_server.base_url}/v1",
                           api_key=thinking_server.api_key, max_retries=0, timeout=120)
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=24)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    free = client.chat.completions.create(**kw, extra_body=off).choices[0].message
    capped = client.chat.completions.create(
        **kw, extra_body={**off, "thinking_token_budget": 6}).choices[0].message
    assert (capped.content, capped.reasoning_content) == (free.content, free.reasoning_content)


def test_adaptive_thinking_and_its_omitted_display(thinking_server: RunningServer):
    claude = anthropic.Anthropic(base_url=thinking_server.base_url,
                                 api_key=thinking_server.api_key, max_retries=0, timeout=120)
    kw = dict(model=MODEL, max_tokens=24, messages=ASK, extra_body={"temperature": 0})
    # Adaptive: thinking on, no budget (this model never closes the block on its own).
    adaptive = claude.messages.create(**kw, thinking={"type": "adaptive"})
    assert [b.type for b in adaptive.content] == ["thinking"] and adaptive.content[0].thinking
    omitted = {"type": "adaptive", "display": "omitted"}
    hidden = claude.messages.create(**kw, thinking=omitted)
    assert [(b.type, b.thinking) for b in hidden.content] == [("thinking", "")]
    with claude.messages.stream(**kw, thinking=omitted) as stream:
        events = list(stream)
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert starts == ["thinking"] and deltas == ["signature_delta"]  # no thinking_delta


def test_a_budget_needs_a_reasoning_parser(server: RunningServer):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4}
    _assert_error(_post(server, "/v1/chat/completions", {**body, "thinking_token_budget": 8}),
                  400, "thinking_token_budget")
    assert _post(server, "/v1/chat/completions",
                 {**body, "reasoning_effort": "high"}).status_code == 200  # nothing to cap
    # Anthropic's thinking asks for the same budget: the error names its field
    refused = _post(server, "/v1/messages", {**body, "max_tokens": 16, "thinking": {
        "type": "enabled", "budget_tokens": 8}})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "thinking.budget_tokens"
    assert error["message"].startswith("thinking.budget_tokens needs a server started with "
                                       "--reasoning-parser")


def test_streamed_thinking_closes_as_the_sdks_expect(thinking_server: RunningServer):
    # Responses: a reasoning item's part is added and done, its text done; Messages: a
    # thinking block ends with its signature (the SDK's final message has one, as unstreamed).
    client = openai.OpenAI(base_url=f"{thinking_server.base_url}/v1",
                           api_key=thinking_server.api_key, max_retries=0, timeout=120)
    events = list(client.responses.create(model=MODEL, input=ASK[0]["content"], stream=True,
                                          temperature=0, max_output_tokens=16))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.delta") > kinds.index(
        "response.content_part.added")
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == "".join(e.delta for e in events
                                if e.type == "response.reasoning_text.delta")
    parts = [e.part.type for e in events if e.type == "response.content_part.done"]
    assert parts[0] == "reasoning_text"
    claude = anthropic.Anthropic(base_url=thinking_server.base_url,
                                 api_key=thinking_server.api_key, max_retries=0, timeout=120)
    kw = dict(model=MODEL, max_tokens=24, messages=ASK, extra_body={"temperature": 0},
              thinking={"type": "adaptive"})
    with claude.messages.stream(**kw) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas[-1] == "signature_delta"
    assert final.content[0].type == "thinking" and final.content[0].signature == ""
    assert final.content == claude.messages.create(**kw).content
