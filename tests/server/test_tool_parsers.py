"""Each tool parser and reasoning parser on canned model outputs of its family: the calls and
content read from the whole text, and the same read from a stream cut at every character."""

from __future__ import annotations

import json

import pytest

from pkv.core.registry import discover, select_tool_parser
from pkv.core.server.chat_choice import ChoiceShaper
from pkv.core.structured_output.reasoning import REASONING_PARSERS
from pkv.core.structured_output.tool_calls import forced_named, forced_required

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"tz": "Europe/Paris"}
CALLS = [("get_weather", WEATHER), ("get_time", TIME)]

# parser -> (model output, expected content, expected [(name, arguments)])
CASES = {
    "hermes": [
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
         '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
         '{"tz": "Europe/Paris"}}\n</tool_call>', "Let me check.\n", CALLS),
        ('<tool_call>{"arguments": {"city": "Paris", "unit": "celsius"}, "name": '
         '"get_weather"}</tool_call>', "", CALLS[:1]),
        ("No tools needed: 2 < 3 and <tool isn't a tag.", "No tools needed: 2 < 3 and <tool "
         "isn't a tag.", []),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        # whitespace before a call is no content, streamed or not; alone it is the content
        ('\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
         '"celsius"}}</tool_call>', "", CALLS[:1]),
        (" \n", " \n", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
         '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}', "", CALLS),
        ('<|python_tag|>{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}', "",
         CALLS[1:]),
        ("The weather is fine.", "The weather is fine.", []),
    ],
    "mistral": [
        ('Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
         '"celsius"}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]', "Sure.",
         CALLS),
        ("[INST] is not [TOOL_CALLS", "[INST] is not [TOOL_CALLS", []),
        # v11 tokenizers (Mistral Small 3.2, Devstral): a marker and a name a call
        ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]'
         'get_time[ARGS]{"tz": "Europe/Paris"}', "Sure.", CALLS),
        ('[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "Europe/Paris"}', "", CALLS[1:]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", unit="celsius"), get_time(tz="Europe/Paris")]', "", CALLS),
        ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
        ("Hello there", "Hello there", []),
        # Python literals that are no JSON value: text, not a failed request
        ("[f(x={1, 2})]", "[f(x={1, 2})]", []), ("[f(x=b'a', y=1j)]", "[f(x=b'a', y=1j)]", []),
    ],
}


def _whole(shaper: ChoiceShaper, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    message, _ = shaper.message(text, "stop")
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in message.get("tool_calls", [])]
    return message["content"], calls


def _streamed(shaper: ChoiceShaper, text: str, cuts: list[int]
              ) -> tuple[str, list[tuple[str, dict]], str]:
    """Content, calls and reasoning reassembled from deltas of `text` cut at `cuts`."""
    content, reasoning = "", ""
    calls: dict[int, dict] = {}
    for end in [*cuts, len(text)]:
        delta = shaper.delta(text[:end], end == len(text))
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        indexes = [d["index"] for d in delta.get("tool_calls", [])]
        # one entry per call a chunk: the openai SDK makes a second call of a second one
        assert len(indexes) == len(set(indexes)), delta
        for d in delta.get("tool_calls", []):
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            if "id" in d:
                assert call["name"] is None and d["type"] == "function" and d["id"]
                call["name"] = d["function"]["name"]
            call["arguments"] += d["function"]["arguments"]
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], reasoning


@pytest.mark.parametrize("name, text, content, calls",
                         [(n, *case) for n, cases in CASES.items() for case in cases])
def test_parser_reads_calls_whole_and_streamed_at_every_cut(name: str, text: str, content: str,
                                                             calls: list) -> None:
    parser = select_tool_parser(name, None)
    whole_content, whole_calls = _whole(ChoiceShaper(parser.extract, None), text)
    assert whole_calls == calls
    assert (whole_content or "") == (content if calls else text)
    for cut in range(len(text) + 1):
        got = _streamed(ChoiceShaper(parser.extract, None), text, [cut])
        assert got[:2] == ((content if calls else text), calls), (cut, got)
    # And one character at a time.
    got = _streamed(ChoiceShaper(parser.extract, None), text, list(range(len(text))))
    assert got[:2] == ((content if calls else text), calls)


def test_auto_picks_the_parser_whose_markers_the_template_has() -> None:
    assert select_tool_parser("auto", "{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert select_tool_parser("auto", "{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert select_tool_parser("auto", "<|python_tag|>").name == "llama3_json"
    assert select_tool_parser("auto", "plain").name == "hermes"  # the fallback prompt's format
    assert set(discover().tool_parsers) >= {"hermes", "llama3_json", "mistral", "pythonic"}
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        select_tool_parser("nope", None)


@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("qwen3", "<think>\nThe user wants Paris.\n</think>\n\nParis is sunny.",
     "The user wants Paris.\n", "Paris is sunny."),
    ("qwen3", "Paris is sunny, no thinking.", "", "Paris is sunny, no thinking."),
    ("deepseek_r1", "The user wants Paris.</think>Paris is sunny.", "The user wants Paris.",
     "Paris is sunny."),
    ("deepseek_r1", "<think>Hmm.</think>\nParis.", "Hmm.", "Paris."),
])
def test_reasoning_is_split_whole_and_at_every_cut(parser: str, text: str, reasoning: str,
                                                   content: str) -> None:
    shaper = ChoiceShaper(None, REASONING_PARSERS[parser])
    message, _ = shaper.message(text, "stop")
    assert (message["reasoning_content"] or "", message["content"]) == (reasoning, content)
    for cut in range(len(text) + 1):
        got = _streamed(ChoiceShaper(None, REASONING_PARSERS[parser]), text, [cut])
        assert (got[2], got[0]) == (reasoning, content), (cut, got)


def test_reasoning_then_a_tool_call() -> None:
    parser = select_tool_parser("hermes", None)
    text = ('<think>Need the weather.</think>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>')
    shaper = ChoiceShaper(parser.extract, REASONING_PARSERS["qwen3"])
    message, finish = shaper.message(text, "stop")
    assert message["reasoning_content"] == "Need the weather." and message["content"] is None
    assert finish == "tool_calls"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_a_call_max_tokens_cut_off_is_a_call_whole_as_streamed() -> None:
    # Whole, as a stream has sent it: the call with its arguments so far, finish_reason length
    # (OpenAI's); the same text ended by the model itself stays content.
    parser = select_tool_parser("hermes", None)
    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    message, finish = ChoiceShaper(parser.extract, None).message(text, "length")
    [call] = message["tool_calls"]
    assert finish == "length" and message["content"] == "Checking.\n"
    assert call["function"]["name"] == "get_weather"
    streamed = _streamed_calls(ChoiceShaper(parser.extract, None), text)
    assert streamed == [("get_weather", call["function"]["arguments"])]
    assert "tool_calls" not in ChoiceShaper(parser.extract, None).message(text, "stop")[0]


def _streamed_calls(shaper: ChoiceShaper, text: str) -> list[tuple[str, str]]:
    """(name, arguments) of the calls a stream of `text` in one chunk sends."""
    calls: dict[int, list] = {}
    for d in shaper.delta(text, True).get("tool_calls", []):
        call = calls.setdefault(d["index"], [d["function"].get("name"), ""])
        call[1] += d["function"]["arguments"]
    return [tuple(c) for c in calls.values()]


def test_forced_outputs_are_read_whole_and_streamed() -> None:
    named = '{"city": "Paris", "unit": "celsius"}'
    required = ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}]')
    for extract, text, calls in ((forced_named("get_weather"), named, CALLS[:1]),
                                 (forced_required, required, CALLS)):
        assert _whole(ChoiceShaper(extract, None), text) == (None, calls)
        for cut in range(len(text) + 1):
            assert _streamed(ChoiceShaper(extract, None), text, [cut])[1] == calls
    # Cut off by max_tokens: the call as far as it got, as a stream sent it.
    message, finish = ChoiceShaper(forced_named("f"), None).message('{"city": "Pa', "length")
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "f", "arguments": '{"city": "Pa'}] and finish == "length"


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_parallel_tool_calls_false_keeps_the_first_call_under_auto(name: str) -> None:
    from pkv.core.server.protocol import ChatCompletionRequest
    from pkv.core.server.tools import plan_tools

    text = CASES[name][0][0]  # two calls
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n, _ in CALLS]
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "?"}], "tools": tools,
        "parallel_tool_calls": False})
    plan = plan_tools(body, select_tool_parser(name, None))
    assert _whole(ChoiceShaper(plan.extractor, None), text)[1] == CALLS[:1]
    streamed = _streamed(ChoiceShaper(plan.extractor, None), text, list(range(len(text))))
    assert streamed[1] == CALLS[:1]
