"""Anthropic's Messages API (`POST /v1/messages`) driven by the official `anthropic` client
against a real `pkv serve` with the bundled model: plain, streamed (the events in order and
the same answer), a tool_use round trip, `x-api-key` auth, and Anthropic-shaped errors."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from pkv.core.server.anthropic_messages import MessagesRequest, to_chat_request
from pkv.tests.server.conftest import RunningServer
from pkv.tests.server.test_http import MODEL, _post

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # (this client version has no sampling arguments of its own)


@pytest.fixture(scope="module")
def claude(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key,
                               max_retries=0, timeout=120)


def test_plain_and_streamed_agree(claude: anthropic.Anthropic):
    message = claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY,
                                     system="Answer in one short sentence.", messages=ASK)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL
    [block] = message.content
    assert block.type == "text" and block.text.strip()
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 10 and 0 < message.usage.output_tokens <= 24

    events = []
    with claude.messages.stream(model=MODEL, max_tokens=24, extra_body=GREEDY,
                                system="Answer in one short sentence.", messages=ASK) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events[1] == "content_block_start" and "content_block_delta" in events
    assert events.index("content_block_stop") < events.index("message_delta")
    assert [b.text for b in final.content] == [block.text]
    assert final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens
    # The same prompt again: read from the prefix cache, counted as Anthropic counts it.
    again = claude.messages.create(model=MODEL, max_tokens=1, extra_body=GREEDY,
                                   system="Answer in one short sentence.", messages=ASK).usage
    assert again.cache_read_input_tokens > 0 and again.cache_creation_input_tokens == 0
    assert _prompt(again) == _prompt(message.usage)
    raw = httpx.post(f"{claude.base_url}".rstrip("/") + "/v1/messages", headers={
        "x-api-key": claude.api_key or ""}, json={
        "model": MODEL, "max_tokens": 2, "messages": ASK, "stream": True}, timeout=60).text
    names = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]  # as Anthropic's


def _prompt(usage: anthropic.types.Usage) -> int:
    """A prompt's tokens: those read from the prefix cache are counted apart."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_a_message_carries_its_request_id(claude: anthropic.Anthropic):
    message = claude.messages.create(model=MODEL, max_tokens=2, messages=ASK, extra_body=GREEDY)
    assert message._request_id and message._request_id.startswith("req_")


def test_output_config_format_constrains_the_answer(claude: anthropic.Anthropic):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    for field in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                  {"output_format": {"type": "json_schema", "schema": schema}}):  # (the beta's)
        message = claude.messages.create(
            model=MODEL, max_tokens=32, messages=[{"role": "user", "content": "Name a city."}],
            extra_body={**GREEDY, **field})
        jsonschema.validate(json.loads(message.content[0].text), schema)


def test_a_final_assistant_turn_is_a_prefill(claude: anthropic.Anthropic):
    whole = claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY,
                                   messages=ASK).content[0].text
    start = " ".join(whole.split()[:3])
    prefilled = [*ASK, {"role": "assistant", "content": start}]
    rest = claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY,
                                  messages=prefilled)
    assert start + rest.content[0].text == whole  # the answer goes on, no new turn
    counted = claude.messages.count_tokens(model=MODEL, messages=prefilled).input_tokens
    assert _prompt(rest.usage) == counted


def test_stop_sequence_is_reported(claude: anthropic.Anthropic):
    first = claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ASK)
    word = first.content[0].text.split()[1]  # a word the answer reaches
    stopped = claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ASK,
                                     stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text


def test_tool_use_round_trip(claude: anthropic.Anthropic):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = claude.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY, tools=[WEATHER],
                                    tool_choice={"type": "tool", "name": "get_weather"},
                                    messages=ask)
    assert called.stop_reason == "tool_use"
    [use] = [b for b in called.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])

    streamed = claude.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY,
                                      tools=[WEATHER], tool_choice={"type": "any"},
                                      messages=ask, stream=True)
    starts, partial = [], ""
    for event in streamed:
        if event.type == "content_block_start":
            starts.append(event.content_block.type)
            assert event.content_block.id.startswith("toolu_")
        elif event.type == "content_block_delta" and event.delta.type == "input_json_delta":
            partial += event.delta.partial_json
        elif event.type == "message_delta":
            assert event.delta.stop_reason == "tool_use"
    assert starts == ["tool_use"]
    jsonschema.validate(json.loads(partial), WEATHER["input_schema"])

    answer = claude.messages.create(
        model=MODEL, max_tokens=24, extra_body=GREEDY, tools=[WEATHER],
        messages=[*ask, {"role": "assistant", "content": called.content},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": use.id,
                       "content": "Sunny, 24 degrees."},
                      {"type": "text", "text": "Tell me in a sentence."}]}])
    assert answer.content and answer.content[0].type == "text"
    assert _prompt(answer.usage) > _prompt(called.usage)  # the result was read
    # A call max_tokens cuts off is still a tool_use block, as a stream gives it.
    cut = claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=ask)
    assert cut.stop_reason == "max_tokens"
    assert [(b.type, b.name) for b in cut.content] == [("tool_use", "get_weather")]


def test_x_api_key_and_errors_in_anthropic_shape(server: RunningServer):
    url = server.base_url + "/v1/messages"
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK}
    ok = httpx.post(url, json=body, headers={"x-api-key": server.api_key}, timeout=60)
    assert ok.status_code == 200 and ok.json()["content"]
    refused = httpx.post(url, json=body, headers={"x-api-key": "wrong"}, timeout=60)
    assert refused.status_code == 401  # answered by the middleware, in Anthropic's shape too
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "authentication_error"
    too_large = httpx.post(url, content=b"x" * (5 * 2**20),
                           headers={"x-api-key": server.api_key}, timeout=60)
    assert too_large.status_code == 413 and too_large.json()["type"] == "error"
    assert too_large.json()["error"]["type"] == "request_too_large"  # Anthropic's own type
    assert "request body is over" in too_large.json()["error"]["message"]
    cases = [({**body, "max_tokens": "4"}, "max_tokens"),
             ({"model": MODEL, "messages": ASK}, "max_tokens"),
             ({**body, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
              "messages[0].content[0]"),
             ({**body, "tool_choice": {"type": "tool"}}, "tool_choice"),
             ({**body, "system": [["Be brief."]]}, "system"),
             ({**body, "messages": [{"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]},
              "messages[0].content[0]"),
             ({**body, "messages": [*ASK, {"role": "assistant", "content": [
                 {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                               "content": 7}]}]},
              "messages[2].content[0].content"),
             ({**body, "stop_sequences": [""]}, "stop_sequences"),
             ({**body, "temperature": 5}, "temperature"),
             ({**body, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
             ({**body, "thinking": {"type": "enabled", "budget_tokens": 4}},
              "thinking.budget_tokens"),
             ({**body, "messages": [*ASK, {"role": "assistant", "content": [
                 {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
                 {"role": "user", "content": "and now?"}]}, "messages[2].content"),
             ({**body, "output_config": {"format": {"type": "json"}}}, "output_config.format"),
             ({**body, "messages": [*ASK, {"role": "assistant", "content": [
                 {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}]},
              "messages[1].content"),
             ({**body, "mcp_servers": [{"type": "url", "url": "https://x.example/mcp",
                                        "name": "x"}]}, "mcp_servers")]
    for bad, param in cases:
        response = _post(server, "/v1/messages", bad)
        assert response.status_code == 400, response.text
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert error["error"]["param"] == param
        assert error["error"]["message"].startswith(param)  # named as this API names it
    assert _post(server, "/v1/messages", body).status_code == 200  # still serving
    text = httpx.get(server.base_url + "/metrics", headers=server.headers).text
    counts = {status: _counter(text, "/v1/messages", status) for status in (200, 400, 401)}
    assert counts[200] >= 2 and counts[400] >= len(cases) and counts[401] >= 1


def _counter(text: str, endpoint: str, status: int) -> float:
    """pkv:http_requests_total{endpoint, status} from a /metrics page."""
    labels = f'endpoint="{endpoint}",status="{status}"'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pkv:http_requests_total{") and labels in line)


def test_the_client_raises_on_a_bad_request(claude: anthropic.Anthropic):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, max_tokens=0, messages=ASK)
    assert "max_tokens" in str(caught.value)


def test_count_tokens_is_the_prompt_a_message_takes(claude: anthropic.Anthropic):
    # What Anthropic-SDK agents ask before sending: the count equals the prompt's tokens (usage's
    # input_tokens and cache_read_input_tokens) of the same conversation sent, with a system
    # prompt, a tool and a tool_use round trip in it.
    turns = [*ASK, {"role": "assistant", "content": [
                 {"type": "text", "text": "Let me look."},
                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                  "input": {"city": "Paris"}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny."}]}]
    for kwargs in ({"messages": ASK},
                   {"messages": turns, "system": "Be brief.", "tools": [WEATHER]}):
        counted = claude.messages.count_tokens(model=MODEL, **kwargs)
        sent = claude.messages.create(model=MODEL, max_tokens=2, **kwargs)
        assert counted.input_tokens == _prompt(sent.usage) > 0
    # A thinking budget (Anthropic's least is 1,024) is no reason to refuse the count; this
    # model's template takes no thinking switch, so the prompt is the same.
    thinking = claude.messages.count_tokens(
        model=MODEL, thinking={"type": "enabled", "budget_tokens": 1024}, **kwargs)
    assert thinking.input_tokens == counted.input_tokens
    without_system = claude.messages.count_tokens(model=MODEL, messages=turns, tools=[WEATHER])
    assert without_system.input_tokens < counted.input_tokens  # the system prompt counted
    with pytest.raises(anthropic.NotFoundError) as unknown:
        claude.messages.count_tokens(model="no-such-model", messages=ASK)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as empty:
        claude.messages.count_tokens(model=MODEL, messages=[])
    assert empty.value.body["error"]["param"] == "messages"


@pytest.mark.parametrize("thinking,enabled", [
    (None, False), ({"type": "disabled"}, False), ({"type": "adaptive"}, True),
    ({"type": "enabled", "budget_tokens": 1024}, True)])
def test_thinking_is_off_unless_asked_for(thinking: dict | None, enabled: bool):
    """Anthropic's default, whatever the template's own (Qwen3 thinks unless told not to)."""
    body = {"model": MODEL, "max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}]}
    chat = to_chat_request(MessagesRequest(**body, thinking=thinking))
    assert chat.chat_template_kwargs == {"enable_thinking": enabled}
