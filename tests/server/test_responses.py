"""OpenAI's Responses API (`POST /v1/responses`, `GET`, cancel) driven by the
official `openai` client against a real `pkv serve`: plain, streamed (events in order, the
final response equal to the non-streamed one at temperature 0), a function tool round trip,
`previous_response_id`, `text.format` json_schema, and 400s naming the field."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from pkv.tests.server.conftest import RunningServer
from pkv.tests.server.test_http import MODEL, _assert_error, _post

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}


def test_plain_and_streamed_agree(client: openai.OpenAI):
    kw = dict(model=MODEL, input="What is the capital of France?", temperature=0,
              max_output_tokens=16, instructions="Answer in one short sentence.")
    plain = client.responses.create(**kw)
    assert plain.object == "response" and plain.id.startswith("resp_")
    assert (plain.completed_at is not None) == (plain.status == "completed")
    assert plain.status in ("completed", "incomplete") and plain.output_text.strip()
    assert plain.usage.input_tokens > 10 and 0 < plain.usage.output_tokens <= 16
    assert plain.temperature == 0 and client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=1).temperature == 1.0  # what it ran with
    kinds, final = [], None
    for event in client.responses.create(**kw, stream=True):
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert "response.output_text.delta" in kinds and kinds[-1] == final.status.join(
        ["response.", ""])
    assert kinds.index("response.output_text.done") < kinds.index("response.output_item.done")
    assert [e for e in kinds if e.endswith(".done")] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert final.output_text == plain.output_text and final.status == plain.status
    assert final.usage.output_tokens == plain.usage.output_tokens
    # The message opens without parts; its part comes in content_part.added (as OpenAI's:
    # clients that add up the parts of a stream would otherwise hold two).
    added = [e for e in client.responses.create(**kw, stream=True)
             if e.type == "response.output_item.added"]
    assert [e.item.content for e in added] == [[]]


def test_logprobs_come_with_the_text_streamed_or_not(client: openai.OpenAI):
    """`include` output_text logprobs with `top_logprobs` alternatives: one entry per generated
    token, the chosen token's text spelling the output; streamed, the deltas carry their own
    tokens' and the final response equals the non-streamed one."""
    kw = dict(model=MODEL, input="Name a colour.", temperature=0, max_output_tokens=8,
              top_logprobs=3, include=["message.output_text.logprobs"])
    plain = client.responses.create(**kw)
    part = plain.output[0].content[0]
    assert len(part.logprobs) == plain.usage.output_tokens
    assert part.text.startswith("".join(lp.token for lp in part.logprobs[:-1]).strip()[:4])
    for lp in part.logprobs:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].logprob >= lp.logprob  # greedy: the chosen one leads
    carried, final = [], None
    for event in client.responses.create(**kw, stream=True):
        if event.type == "response.output_text.delta":
            assert event.logprobs  # each delta: the tokens that made it
            carried += event.logprobs
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    streamed = final.output[0].content[0].logprobs
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    # (a prefix-cache hit sums in another order: the values agree closely, not bit for bit)
    assert [lp.logprob for lp in streamed] == pytest.approx(
        [lp.logprob for lp in part.logprobs], abs=1e-3)
    assert [lp.token for lp in carried] == [lp.token for lp in part.logprobs[:len(carried)]]
    without = client.responses.create(**{k: v for k, v in kw.items()
                                         if k not in ("top_logprobs", "include")})
    assert without.output[0].content[0].logprobs == []


def test_a_stream_the_client_leaves_is_stored_as_cancelled(server: RunningServer,
                                                           client: openai.OpenAI):
    body = {"model": MODEL, "input": "Write a very long story about dragons.",
            "max_output_tokens": 600, "stream": True}
    response_id = None
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body,
                      headers=server.headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and response_id is None:
                response_id = json.loads(line[6:])["response"]["id"]
            if line.startswith("data: ") and "output_text.delta" in line:
                break  # leave mid-stream, some text received
    deadline = time.monotonic() + 20
    while True:
        try:
            left = client.responses.retrieve(response_id)
            break
        except openai.NotFoundError:
            assert time.monotonic() < deadline, "never stored"
            time.sleep(0.1)
    assert left.status == "cancelled" and left.output[0].type == "message"
    assert left.output[0].content[0].text and left.output[0].status == "incomplete"


def test_the_item_max_output_tokens_cuts_short_is_incomplete(client: openai.OpenAI):
    kw = dict(model=MODEL, input="Write a long story about a cat.", temperature=0,
              max_output_tokens=3)
    plain = client.responses.create(**kw)
    assert plain.status == "incomplete"
    assert plain.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in plain.output] == ["incomplete"]
    done = [event.item for event in client.responses.create(**kw, stream=True)
            if event.type == "response.output_item.done"]
    assert [item.status for item in done] == ["incomplete"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # the grammar ends it well within 40 tokens
    whole = client.responses.create(**{**kw, "max_output_tokens": 40}, text={"format": {
        "type": "json_schema", "name": "ok", "schema": schema}})
    assert whole.status == "completed" and whole.output[-1].status == "completed"


def test_function_call_round_trip_and_previous_response(client: openai.OpenAI):
    ask = "What is the weather in Paris?"
    called = client.responses.create(model=MODEL, input=ask, tools=[WEATHER],
                                     tool_choice={"type": "function", "name": "get_weather"},
                                     temperature=0, max_output_tokens=48)
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    streamed_args, kinds, done, streamed = "", [], None, None
    for event in client.responses.create(model=MODEL, input=ask, tools=[WEATHER],
                                         tool_choice="required", temperature=0,
                                         max_output_tokens=48, stream=True):
        kinds.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            streamed_args += event.delta
        elif event.type == "response.function_call_arguments.done":
            done = event
        elif event.type == "response.completed":
            streamed = event.response
    assert done is not None and done.name == "get_weather" and done.arguments == streamed_args
    cut = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], temperature=0,
                                  tool_choice={"type": "function", "name": "get_weather"},
                                  max_output_tokens=4)  # a call cut off: still a call
    assert [(i.type, i.status, i.name) for i in cut.output] == [
        ("function_call", "incomplete", "get_weather")]
    after_cut = client.responses.create(model=MODEL, previous_response_id=cut.id,
                                        input="Never mind.", max_output_tokens=2)
    assert after_cut.previous_response_id == cut.id  # the conversation goes on
    jsonschema.validate(json.loads(streamed_args), WEATHER["parameters"])
    # A streamed call is answered by its id as the stream gave it.
    [streamed_call] = [item for item in streamed.output if item.type == "function_call"]
    after_stream = client.responses.create(
        model=MODEL, previous_response_id=streamed.id, tools=[WEATHER], temperature=0,
        max_output_tokens=4, input=[{"type": "function_call_output",
                                     "call_id": streamed_call.call_id, "output": "Sunny."}])
    assert after_stream.previous_response_id == streamed.id
    as_parts = client.responses.create(  # the output as input_text parts: the same text
        model=MODEL, previous_response_id=streamed.id, tools=[WEATHER], temperature=0,
        max_output_tokens=4, input=[{"type": "function_call_output",
                                     "call_id": streamed_call.call_id,
                                     "output": [{"type": "input_text", "text": "Sunny."}]}])
    assert as_parts.usage.input_tokens == after_stream.usage.input_tokens
    assert as_parts.output_text == after_stream.output_text

    # The result goes back by previous_response_id: the stored turn is the history.
    answer = client.responses.create(
        model=MODEL, previous_response_id=called.id, tools=[WEATHER], temperature=0,
        max_output_tokens=16, input=[{"type": "function_call_output", "call_id": call.call_id,
                                      "output": "Sunny, 24 degrees."}])
    assert answer.output_text.strip() and answer.previous_response_id == called.id
    assert answer.usage.input_tokens > called.usage.input_tokens
    # The same, with the history sent as items instead.
    explicit = client.responses.create(
        model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=16, input=[
            {"role": "user", "content": ask},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id,
             "output": "Sunny, 24 degrees."}])
    assert explicit.output_text == answer.output_text
    assert client.responses.retrieve(answer.id).output_text == answer.output_text
    client.responses.delete(answer.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answer.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(answer.id)


def test_responses_and_input_items_are_whole_as_the_sdk_types_them(server: RunningServer,
                                                                   client: openai.OpenAI):
    # The client parses leniently (a missing field reads None); its types, validated, do not.
    from openai.types.responses import Response
    from openai.types.responses.response_item_list import ResponseItemList

    made = client.responses.create(model=MODEL, tools=[WEATHER], temperature=0,
                                   max_output_tokens=4, input=[
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Where?"},
        {"role": "user", "content": "Paris."},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny."}])
    url = f"{server.base_url}/v1/responses/{made.id}"
    stored = httpx.get(url, headers=server.headers, timeout=60).json()
    assert Response.model_validate(stored).usage.input_tokens_details.cached_tokens >= 0
    listed = httpx.get(f"{url}/input_items", headers=server.headers, timeout=60).json()
    items = ResponseItemList.model_validate(listed).data
    assert [i.type for i in items][:2] == ["function_call_output", "function_call"]
    assert all(i.status == "completed" for i in items)


def test_json_schema_format(client: openai.OpenAI):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    response = client.responses.create(
        model=MODEL, input="Name a city in JSON.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), schema)


def test_bad_requests_name_the_field(server: RunningServer, client: openai.OpenAI):
    base = {"model": MODEL, "input": "Hi"}
    for body, param in [({**base, "max_output_tokens": 0}, "max_output_tokens"),
                        ({**base, "input": [{"type": "image"}]}, "input[0]"),
                        ({**base, "tools": [{"type": "web_search"}]}, "tools[0]"),
                        ({**base, "previous_response_id": "resp_nope"}, "previous_response_id"),
                        ({**base, "temperature": "hot"}, "temperature"),
                        ({**base, "input": [{"type": "function_call_output", "call_id": "c1",
                                             "output": "5"}]}, "input[0]"),
                        ({**base, "input": [{"role": "user", "content": [["Hi"]]}]},
                         "input[0].content[0]"),
                        ({**base, "input": [{"type": "function_call_output", "call_id": ["c"],
                                             "output": "5"}]}, "input[0]"),
                        ({**base, "text": {"format": {"type": "json"}}}, "text.format"),
                        ({**base, "text": {"format": "json_object"}}, "text.format"),
                        ({**base, "text": {"format": {"type": "json_schema", "name": "x"}}},
                         "text.format.schema"),
                        ({**base, "truncation": "sometimes"}, "truncation"),
                        ({**base, "top_logprobs": 500}, "top_logprobs"),
                        ({**base, "include": ["bogus"]}, "include[0]"),
                        ({**base, "input": [{"type": "function_call", "call_id": "c1",
                                             "name": "f", "arguments": "{oops"}]},
                         "input[0].arguments"),
                        ({**base, "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
                        ({**base, "conversation": "conv_1"}, "conversation"),
                        ({**base, "prompt": {"id": "pmpt_1"}}, "prompt"),
                        ({**base, "tools": [{**WEATHER, "name": "a b!"}]}, "tools[0].name"),
                        ({**base, "text": {"format": {"type": "json_schema",
                                                      "schema": {"type": "object"}}}},
                         "text.format.name"),
                        ({**base, "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
                        ({**base, "metadata": {"k": "v" * 513}}, "metadata")]:
        response = _post(server, "/v1/responses", body)
        error = _assert_error(response, 404 if param == "previous_response_id" else 400, param)
        assert "max_tokens" not in error["message"]  # the field as this API calls it
    for effort in ("none", "minimal", "xhigh", "max"):  # every effort OpenAI names
        assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=1,
                                       reasoning={"effort": effort}).status
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    stored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    replay = httpx.get(f"{server.base_url}/v1/responses/{stored.id}?stream=true",
                       headers=server.headers, timeout=30)
    _assert_error(replay, 400, "stream")  # not replayed: a 400, not JSON where SSE was asked
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def _wait_for(client: openai.OpenAI, response_id: str, done: tuple[str, ...]) -> object:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        response = client.responses.retrieve(response_id)
        if response.status in done:
            return response
        time.sleep(0.2)
    raise AssertionError(f"{response_id} never reached {done}")


def test_background_response_runs_on_and_a_cancel_stops_it(server: RunningServer,
                                                            client: openai.OpenAI):
    plain = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=8,
                                    temperature=0)
    queued = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=8,
                                     temperature=0, background=True)
    assert queued.status == "queued" and queued.background is True
    done = _wait_for(client, queued.id, ("completed", "incomplete"))
    assert done.output_text == plain.output_text and done.usage.output_tokens > 0

    long = client.responses.create(model=MODEL, input="Write a very long story.",
                                   max_output_tokens=900, background=True)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    # Cancelled once it has written: the text so far, and what it took
    running = client.responses.create(model=MODEL, input="Write a very long story.",
                                      max_output_tokens=900, background=True)
    deadline = time.monotonic() + 60
    while not client.responses.retrieve(running.id).output_text:  # GET: the text so far
        assert time.monotonic() < deadline, "no output while in progress"
        time.sleep(0.1)
    partial = client.responses.cancel(running.id)
    assert partial.status == "cancelled" and partial.output[0].status == "incomplete"
    assert partial.output_text and partial.usage.output_tokens > 0
    assert client.responses.retrieve(running.id).output_text == partial.output_text
    deadline = time.monotonic() + 30
    while server.metrics()["pkv:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.1)  # the abort reaches the engine between steps
    values = server.metrics()
    assert values["pkv:num_requests_running"] == 0
    assert values["pkv:kv_blocks_free"] == values["pkv:kv_blocks_total"]
    assert client.responses.cancel(done.id).status == done.status  # finished: as it was
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain.id)  # not a background response
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
    _assert_error(_post(server, "/v1/responses", {"model": MODEL, "input": "Hi",
                                                  "background": True, "stream": True}),
                  400, "background")


def test_deleting_a_running_background_response_stops_it_for_good(server: RunningServer,
                                                                  client: openai.OpenAI):
    running = client.responses.create(model=MODEL, input="Write a very long story.",
                                      max_output_tokens=400, background=True)
    deadline = time.monotonic() + 60
    while not client.responses.retrieve(running.id).output_text:
        assert time.monotonic() < deadline, "no output while in progress"
        time.sleep(0.1)
    assert client.responses.delete(running.id) is None  # the SDK's answer to a deletion
    deadline = time.monotonic() + 30
    while server.metrics()["pkv:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    values = server.metrics()
    assert values["pkv:num_requests_running"] == 0  # stopped, not run to its 400 tokens
    assert values["pkv:kv_blocks_free"] == values["pkv:kv_blocks_total"]
    time.sleep(0.5)  # (what the task would store, it would have stored by now)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(running.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(running.id)


def test_input_items_list_a_conversation_newest_first(server: RunningServer,
                                                      client: openai.OpenAI):
    first = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4,
                                    temperature=0, instructions="Be brief.")
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, max_output_tokens=4, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Another?"}]},
               {"type": "message", "role": "user", "content": "And a third?"}])
    assert [i.type for i in client.responses.input_items.list(first.id)] == ["message"]
    # Earlier turns included (their input, their answer), then this one's; newest first,
    # the client paging by `after` from one item at a time.
    items = list(client.responses.input_items.list(second.id, limit=1))
    assert [(i.role, i.content[0].text) for i in items] == [
        ("user", "And a third?"), ("user", "Another?"),
        ("assistant", first.output_text), ("user", "Name a colour.")]
    assert items[2].id == first.output[0].id and len({i.id for i in items}) == 4
    oldest = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.id for i in oldest.data] == [i.id for i in items[::-1][:2]] and oldest.has_more
    before = client.responses.input_items.list(second.id, order="asc",
                                               extra_query={"before": items[0].id})
    assert [i.id for i in before.data] == [i.id for i in items[::-1][:3]]
    for query, param in (({"limit": 0}, "limit"), ({"limit": "abc"}, "limit"),
                         ({"order": "sideways"}, "order"),
                         ({"after": "msg_none"}, "after")):
        response = httpx.get(f"{server.base_url}/v1/responses/{second.id}/input_items",
                             params=query, headers=server.headers, timeout=60)
        _assert_error(response, 400, param)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")


def test_truncation_auto_drops_the_earliest_messages_that_do_not_fit(server: RunningServer,
                                                                     client: openai.OpenAI):
    # Four long turns and a question: over the server's max_model_len of 1,024 tokens.
    long = [{"role": role, "content": f"{i} " + "apple " * 300}
            for i, role in enumerate(["user", "assistant", "user", "assistant"])]
    question = {"role": "user", "content": "How many turns were there?"}
    body = {"model": MODEL, "input": [*long, question], "max_output_tokens": 4,
            "temperature": 0, "instructions": "Be brief."}
    _assert_error(_post(server, "/v1/responses", body), 400, "input", "context_length_exceeded")
    cut = client.responses.create(**body, truncation="auto")
    assert cut.status in ("completed", "incomplete") and cut.truncation == "auto"
    # The fewest messages dropped, from the start: the same prompt as sending the rest.
    for dropped in (1, 2, 3):
        rest = {**body, "input": [*long[dropped:], question]}
        fitting = _post(server, "/v1/responses", rest)
        if fitting.status_code == 200:
            break
    assert cut.usage.input_tokens == fitting.json()["usage"]["input_tokens"]
    assert cut.output_text == fitting.json()["output"][0]["content"][0]["text"]
    assert dropped < 4 and cut.usage.input_tokens + 4 <= 1024
    alone = {**body, "input": [{"role": "user", "content": "apple " * 1100}]}
    _assert_error(_post(server, "/v1/responses", {**alone, "truncation": "auto"}), 400,
                  "input", "context_length_exceeded")  # the last message alone is too long


def test_a_response_reports_the_models_sampling_defaults(tmp_path, tiny_llama_dir):
    """Unsent temperature and top_p run at generation_config.json's values, and the response
    says so (not OpenAI's 1.0)."""
    import shutil

    from pkv.tests.server.conftest import start_server, stop_server

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    running = start_server(str(tmp_path), str(model), "--max-model-len", "256", api_key=None)
    try:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="none",
                               max_retries=0, timeout=60)
        name = client.models.list().data[0].id
        made = client.responses.create(model=name, input="hi", max_output_tokens=2)
        assert (made.temperature, made.top_p) == (0.6, 0.9)
        sent = client.responses.create(model=name, input="hi", max_output_tokens=2,
                                       temperature=0.2)
        assert (sent.temperature, sent.top_p) == (0.2, 0.9)
    finally:
        stop_server(running)
