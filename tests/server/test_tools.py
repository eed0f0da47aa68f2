"""Tool calling through the official `openai` client against a real `pkv serve` with the
bundled 135M model: forced calls always validate, streams reassemble to the same calls,
histories with tool results render, and bad tool input is a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pkv.tests.server.conftest import RunningServer
from pkv.tests.server.test_http import MODEL, _assert_error, _post

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string",
                                                               "maxLength": 30}},
                       "required": ["tz"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


def _valid_calls(message) -> list[tuple[str, dict]]:  # noqa: ANN001 - an openai message
    """Every call's name is a tool and its arguments validate against that tool's schema."""
    calls = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def _streamed_calls(client: openai.OpenAI, **kw) -> tuple[list[tuple[str, dict]], str]:
    calls: dict[int, dict] = {}
    finish = ""
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        choice = chunk.choices[0]
        assert choice.delta.content in (None, "")  # no markup leaks into content
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": None, "arguments": ""})
            if d.id is not None:
                assert call["name"] is None and d.type == "function"
                call["name"] = d.function.name
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return [(c["name"], json.loads(c["arguments"])) for c in calls.values()], finish


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_forced_calls_validate_and_stream_the_same(client: openai.OpenAI,
                                                   tool_choice: object) -> None:
    kw = {"messages": ASK, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 60,
          "temperature": 0}
    out = client.chat.completions.create(model=MODEL, **kw).choices[0]
    calls = _valid_calls(out.message)
    assert calls and out.finish_reason == "tool_calls" and out.message.content is None
    if tool_choice == NAMED:
        assert [name for name, _ in calls] == ["get_time"]
    assert _streamed_calls(client, **kw) == (calls, "tool_calls")


def test_a_required_call_of_a_tool_with_definitions_validates(client: openai.OpenAI) -> None:
    # Pydantic models as tools (openai.pydantic_function_tool) reference their $defs: inside
    # the array of calls that tool_choice "required" builds, the references still resolve.
    address = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
               "required": ["city", "zip"], "additionalProperties": False}
    parameters = {"type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}},
                  "required": ["to"], "additionalProperties": False,
                  "$defs": {"Address": address}}
    tools = [*TOOLS, {"type": "function", "function": {"name": "send_letter",
                                                       "parameters": parameters}}]
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Send a letter to Paris."}],
        tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=80,
        temperature=0)
    calls = out.choices[0].message.tool_calls
    assert calls and out.choices[0].finish_reason == "tool_calls"
    schemas = {**SCHEMAS, "send_letter": parameters}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_n_2_sampled_calls_all_validate(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, n=2,
                                         tool_choice="required", max_tokens=60, temperature=0.8,
                                         seed=7)
    assert len(out.choices) == 2
    for choice in out.choices:
        assert _valid_calls(choice.message) and choice.finish_reason == "tool_calls"


def test_parallel_tool_calls_false_gives_one_call(client: openai.OpenAI) -> None:
    for seed in range(3):
        out = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80,
            temperature=1.0, seed=seed, parallel_tool_calls=False)
        assert len(_valid_calls(out.choices[0].message)) == 1


@pytest.mark.parametrize("tool_choice", ["none", "auto"])
def test_none_and_auto_answer_in_text_or_valid_calls(client: openai.OpenAI,
                                                     tool_choice: str) -> None:
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                         tool_choice=tool_choice, max_tokens=16, temperature=0)
    choice = out.choices[0]
    if tool_choice == "none" or not choice.message.tool_calls:
        assert choice.message.tool_calls is None and choice.message.content
        assert "<tool_call>" not in choice.message.content
        assert choice.finish_reason in ("stop", "length")
    else:
        assert _valid_calls(choice.message) and choice.finish_reason == "tool_calls"


def test_a_history_with_a_tool_result(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {
                                               "name": "get_weather"}},
                                           max_tokens=60, temperature=0).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                         tool_choice="none", max_tokens=24, temperature=0)
    assert out.choices[0].message.content


BAD = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": None, "tool_choice": NAMED}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": 5}}}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "x " * 3000}}]},
     "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tools"),
    ({"messages": [*ASK, {"role": "tool", "content": "22 degrees"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": "{not json"}}]}]},
     "messages[1].tool_calls"),
]


@pytest.mark.parametrize("change, param", BAD)
def test_bad_tool_input_is_a_400_naming_the_field(server: RunningServer, change: dict,
                                                  param: str) -> None:
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **change}
    _assert_error(_post(server, "/v1/chat/completions", body), 400, param)


def test_instructor_extracts_a_pydantic_model_through_tool_calls(server: RunningServer) -> None:
    """A real third-party client: instructor in TOOLS mode sends the model's JSON schema as
    the one tool, forces it, and validates the call's arguments back into the model."""
    from typing import Literal

    import instructor
    from pydantic import BaseModel, Field

    class Address(BaseModel):
        city: str = Field(max_length=20)
        country: Literal["FR", "DE", "IT"]

    class Person(BaseModel):
        """A person mentioned in the text."""

        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)
        address: Address

    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0),
        mode=instructor.Mode.TOOLS)
    person = client.chat.completions.create(
        model=MODEL, response_model=Person, max_retries=0, temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "Marie, 34, lives in Lyon, France."}])
    assert isinstance(person, Person) and isinstance(person.address, Address)
    assert 0 <= person.age <= 120


QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def test_templates_that_know_tools_get_them_and_others_a_system_block() -> None:
    from pkv.core.model_loader.loader import bundled_model_path, open_model
    from pkv.core.server.protocol import ChatMessage
    from pkv.core.server.tools import template_messages

    tokenizer = open_model(str(bundled_model_path())).tokenizer
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [ChatMessage(role="user", content="Weather?"),
               ChatMessage(role="assistant", content=None, tool_calls=[call]),
               ChatMessage(role="tool", content="sunny", tool_call_id="c1")]
    messages = [m.as_template_dict() for m in history]
    # A template that renders tools: they and the calls go in as they are, arguments as an
    # object (`tojson` of the JSON text would quote it twice).
    assert template_messages(messages, TOOLS, QWEN_LIKE) is messages
    tokenizer.chat_template = QWEN_LIKE  # (compiled by source: no stale template)
    text = tokenizer.apply_chat_template(messages, True, tools=TOOLS)
    assert '"name": "get_time"' in text and '"arguments": {"city": "Paris"}' in text
    # The bundled template ignores tools: a system block asks for hermes calls, and past
    # calls and results are written in that format.
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    fallback = template_messages(messages, TOOLS, plain)
    assert fallback[0]["role"] == "system" and "<tool_call>" in fallback[0]["content"]
    assert '"get_weather"' in fallback[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in \
        fallback[2]["content"]
    assert fallback[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>",
                           "tool_call_id": "c1"}
