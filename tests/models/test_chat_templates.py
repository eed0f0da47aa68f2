"""Chat templates render through the model's own template, as pkv loads it from a model
folder (tokenizer_config.json's `chat_template`, or chat_template.jinja): Gemma's (no system
role: the system prompt opens the first user turn; Gemma 2's refuses it), and Qwen3's
`enable_thinking`, which requests pass in `chat_template_kwargs`. The templates are short
versions of the families' own, written here."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from pkv import LLM, SamplingParams
from pkv.core.tokenizer.tokenizer import Tokenizer

GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

GEMMA2_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {{ raise_exception('System role not supported') }}
{%- endif -%}
{%- for message in messages -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (message['content'] | trim) + '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}
"""

QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "  What is 2+2? "}]


def _model_folder(out: Path, model_dir: Path, template: str, in_config: bool) -> Path:
    """`model_dir`'s weights (linked) with SmolLM2's tokenizer and `template` as its chat
    template, in tokenizer_config.json or in chat_template.jinja."""
    out.mkdir()
    for item in model_dir.iterdir():
        if item.name not in ("tokenizer_config.json", "chat_template.jinja"):
            (out / item.name).symlink_to(item)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config["bos_token"] = "<|endoftext|>"
    if in_config:
        config["chat_template"] = template
    else:
        (out / "chat_template.jinja").write_text(template)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    return _model_folder(tmp_path_factory.mktemp("gemma-chat") / "m", tiny_llama_dir,
                         GEMMA3_TEMPLATE, in_config=True)


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path
                    ) -> Tokenizer:
    folder = _model_folder(tmp_path_factory.mktemp("qwen3-chat") / "m", tiny_llama_dir,
                           QWEN3_TEMPLATE, in_config=False)
    return Tokenizer.from_folder(folder)


def test_gemma_folds_the_system_prompt_into_the_first_user_turn(gemma_folder: Path):
    tokenizer = Tokenizer.from_folder(gemma_folder)
    assert tokenizer.apply_chat_template(CHAT) == (
        "<|endoftext|><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert tokenizer.apply_chat_template(CHAT[1:2], add_generation_prompt=False) == (
        "<|endoftext|><start_of_turn>user\nHi!<end_of_turn>\n")
    with pytest.raises(ValueError, match="alternate"):
        tokenizer.apply_chat_template(CHAT[1:2] * 2)


def test_a_template_that_does_not_compile_is_named_at_load_and_refused_at_chat(
        tmp_path: Path, tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture):
    broken = "{% for message in messages %}{{ message['content'] }}\n{% if %}"
    with caplog.at_level("WARNING", logger="pkv.tokenizer"):
        tokenizer = Tokenizer.from_folder(_model_folder(tmp_path / "m", tiny_llama_dir, broken,
                                                        in_config=False))
    assert "chat template does not compile (line 2" in caplog.text
    assert tokenizer.encode("Hi", add_special_tokens=False)  # completions still work
    with pytest.raises(ValueError, match=r"does not compile \(line 2: .*\); chat requests"):
        tokenizer.apply_chat_template(CHAT)


def test_gemma2_template_refuses_a_system_prompt(tmp_path: Path, tiny_llama_dir: Path):
    tokenizer = Tokenizer.from_folder(_model_folder(tmp_path / "m", tiny_llama_dir,
                                                    GEMMA2_TEMPLATE, in_config=True))
    assert tokenizer.apply_chat_template(CHAT[1:]) == (
        "<|endoftext|><start_of_turn>user\nHi!<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ValueError, match="System role not supported"):
        tokenizer.apply_chat_template(CHAT)


def test_llm_chat_prompts_through_the_model_template(gemma_folder: Path):
    llm = LLM(str(gemma_folder), kv_cache_memory="16MiB", show_progress=False)
    tokenizer = llm.get_tokenizer()
    outs = llm.chat([CHAT, CHAT[1:2]], SamplingParams(temperature=0, max_tokens=1))
    for out, conversation in zip(outs, [CHAT, CHAT[1:2]]):
        text = tokenizer.apply_chat_template(conversation)
        assert text.endswith("<start_of_turn>model\n")
        assert out.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    llm.shutdown()


def test_llm_chat_passes_template_kwargs(tmp_path: Path, tiny_llama_dir: Path):
    folder = _model_folder(tmp_path / "m", tiny_llama_dir, QWEN3_TEMPLATE, in_config=False)
    llm = LLM(str(folder), kv_cache_memory="16MiB", show_progress=False)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=1)
    thinking = llm.chat(CHAT, params)[0].prompt_token_ids
    quiet = llm.chat(CHAT, params, chat_template_kwargs={"enable_thinking": False})[0]
    text = tokenizer.apply_chat_template(CHAT, enable_thinking=False)
    assert text.endswith("<think>\n\n</think>\n\n")
    assert quiet.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert len(quiet.prompt_token_ids) > len(thinking)
    llm.shutdown()


def test_qwen3_enable_thinking_false_adds_an_empty_think_block(qwen3_tokenizer: Tokenizer):
    head = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n"
            "<|im_start|>user\n  What is 2+2? <|im_end|>\n<|im_start|>assistant\n")
    assert qwen3_tokenizer.apply_chat_template(CHAT) == head
    assert qwen3_tokenizer.apply_chat_template(CHAT, enable_thinking=True) == head
    assert qwen3_tokenizer.apply_chat_template(CHAT, enable_thinking=False) == (
        head + "<think>\n\n</think>\n\n")
    # earlier turns' reasoning is dropped from the history
    thought = [*CHAT[:2], {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello."}]
    assert qwen3_tokenizer.apply_chat_template(thought, add_generation_prompt=False) == (
        head[:head.index("<|im_start|>user\n  What")])


def test_server_passes_chat_template_kwargs_to_the_template(qwen3_tokenizer: Tokenizer):
    # `LLM.chat` takes no template variables; the OpenAI server's chat_template_kwargs do.
    from pkv.core.server.protocol import ChatCompletionRequest
    from pkv.core.server.serving_chat import OpenAIServingChat
    from pkv.core.server.serving_engine import ServerLimits

    engine = SimpleNamespace(engine=SimpleNamespace(tokenizer=qwen3_tokenizer))
    serving = OpenAIServingChat(engine, "m", ServerLimits())  # type: ignore[arg-type]

    def render(**kwargs: object) -> str:
        body = ChatCompletionRequest(messages=CHAT[1:2], **kwargs)
        return asyncio.run(serving._render_chat(body))

    prompt = "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert render() == prompt
    assert render(chat_template_kwargs={"enable_thinking": False}) == (
        prompt + "<think>\n\n</think>\n\n")
    assert render(chat_template_kwargs={"enable_thinking": True}) == prompt
    # what the template never reads is dropped (as vLLM drops it), not refused
    assert render(chat_template_kwargs={"enable_thinking": False, "documents": [{"a": 1}]}) \
        == prompt + "<think>\n\n</think>\n\n"


def test_what_templates_read_as_transformers_gives_it(tmp_path: Path, tiny_llama_dir: Path):
    # The tokenizer's own eos_token (not the smallest EOS id), {% generation %}, a thinking
    # block under each of its names, no null field, text parts joined by newlines, and a
    # request's reasoning_effort where the template reads it.
    from pkv.core.server.protocol import ChatCompletionRequest
    from pkv.core.server.serving_chat import OpenAIServingChat
    from pkv.core.server.serving_engine import ServerLimits
    from pkv.core.tokenizer.chat_messages import template_message

    template = ("{% for m in messages %}{{ m.role }}:{% if m.role == 'assistant' %}"
                "{% generation %}[{{ m.thinking }}]{{ m.content }}{% endgeneration %}"
                "{% if 'tool_calls' in m %}{{ m.tool_calls | length }}{% endif %}"
                "{% else %}{{ m.content }}{% endif %}{{ eos_token }}{% endfor %}"
                "{{ reasoning_effort | default('-') }}")
    folder = _model_folder(tmp_path / "m", tiny_llama_dir, template, in_config=True)
    tokenizer = Tokenizer.from_folder(folder, eos_token_ids=(0,))  # generation_config's 0
    assert 0 in tokenizer.eos_token_ids and tokenizer.own_eos_id == 2
    turns = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": "c", "reasoning": "r", "tool_calls": None}]
    text = tokenizer.apply_chat_template([template_message(m) for m in turns],
                                         add_generation_prompt=False)
    assert text == "user:a\nb<|im_end|>assistant:[r]c<|im_end|>-"
    engine = SimpleNamespace(engine=SimpleNamespace(tokenizer=tokenizer))
    serving = OpenAIServingChat(engine, "m", ServerLimits())  # type: ignore[arg-type]
    body = ChatCompletionRequest(messages=turns[:1], reasoning_effort="low")
    assert asyncio.run(serving._render_chat(body)).endswith("<|im_end|>low")


def test_template_folder_layouts_are_both_read(gemma_folder: Path, tmp_path: Path):
    # chat_template.jinja alone (transformers 5.x writes it so) gives the same template
    folder = tmp_path / "jinja"
    shutil.copytree(gemma_folder, folder, symlinks=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "chat_template.jinja").write_text(config.pop("chat_template"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_folder(folder).chat_template == GEMMA3_TEMPLATE


def test_a_tool_use_template_renders_conversations_with_tools(tmp_path: Path,
                                                            tiny_llama_dir: Path):
    # Hermes-2-Pro's layout: named templates, "tool_use" for a conversation with tools; and
    # transformers 5's folder of additional templates. Both as transformers renders them.
    from transformers import AutoTokenizer

    default = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    tool_use = "TOOLS {{ tools | length }}\n" + default
    named = _model_folder(tmp_path / "named", tiny_llama_dir, default, in_config=True)
    config = json.loads((named / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": default},
                               {"name": "tool_use", "template": tool_use}]
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    folder = _model_folder(tmp_path / "folder", tiny_llama_dir, default, in_config=False)
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(tool_use)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for model in (named, folder):
        ours, theirs = Tokenizer.from_folder(model), AutoTokenizer.from_pretrained(model)
        for given in (None, tools):
            text = ours.apply_chat_template(CHAT[1:2], False, tools=given)
            assert text == theirs.apply_chat_template(CHAT[1:2], tools=given, tokenize=False)
            assert text.startswith("TOOLS 1") == (given is not None)


TOOLS_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\nTools:\\n' }}
    {%- for tool in tools %}
        {{- tool.function.name + ': ' + tool.function.description + '\\n' }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                            "parameters": {"type": "object"}}}


@pytest.mark.parametrize("template", [GEMMA3_TEMPLATE, QWEN3_TEMPLATE, TOOLS_TEMPLATE])
def test_continue_final_message_ends_inside_it_as_transformers(tmp_path: Path,
                                                               tiny_llama_dir: Path,
                                                               template: str):
    import transformers

    folder = _model_folder(tmp_path / "m", tiny_llama_dir, template, in_config=True)
    ours, theirs = Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(
        folder)
    started = [*CHAT[:2], {"role": "assistant", "content": "The answer is "}]
    text = ours.apply_chat_template(started, False, continue_final_message=True)
    assert text == theirs.apply_chat_template(started, tokenize=False,
                                              continue_final_message=True)
    assert text.rstrip().endswith("The answer is")  # no end of turn after it
    with pytest.raises(ValueError, match="cannot both be set"):
        ours.apply_chat_template(started, continue_final_message=True)


def test_llm_chat_takes_tools_and_continues_a_message(tmp_path: Path, tiny_llama_dir: Path):
    import transformers

    folder = _model_folder(tmp_path / "m", tiny_llama_dir, TOOLS_TEMPLATE, in_config=True)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    llm = LLM(str(folder), kv_cache_memory="16MiB", show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=1)
    with_tools = llm.chat(CHAT[1:2], params, tools=[WEATHER])[0]
    assert with_tools.prompt_token_ids == theirs.apply_chat_template(
        CHAT[1:2], tools=[WEATHER], add_generation_prompt=True, tokenize=True,
        return_dict=False)
    assert "get_weather: Weather now." in theirs.decode(with_tools.prompt_token_ids)
    started = [*CHAT[1:2], {"role": "assistant", "content": "Hello, I"}]
    going_on = llm.chat(started, params, add_generation_prompt=False,
                        continue_final_message=True)[0]
    assert theirs.decode(going_on.prompt_token_ids).endswith("Hello, I")
    llm.shutdown()


DATED_TEMPLATE = """{%- set today = strftime_now("%d %B %Y") %}
{{- 'Today is ' + today + '.\n' }}
{%- for message in messages %}
    {{- message.role + ': ' + message | tojson(ensure_ascii=True, sort_keys=True,
                                               separators=(',', ':')) + '\n' }}
{%- endfor %}"""


def test_templates_get_transformers_strftime_now_and_tojson_options(tmp_path: Path,
                                                                     tiny_llama_dir: Path):
    from transformers import AutoTokenizer

    folder = _model_folder(tmp_path / "m", tiny_llama_dir, DATED_TEMPLATE, in_config=True)
    chat = [{"role": "user", "content": "Café? 日本"}]
    ours = Tokenizer.from_folder(folder).apply_chat_template(chat, add_generation_prompt=False)
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        chat, tokenize=False, add_generation_prompt=False)
    assert ours == theirs
    assert "\\u00e9" in ours and '{"content":' in ours
