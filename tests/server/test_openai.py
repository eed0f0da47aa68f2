"""The server through the official `openai` client: chat, completions, streaming, n, stop,
logprobs, usage, models."""

from __future__ import annotations

import json
import re
import uuid

import openai
import pytest

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Once upon a time, in a small village by the sea, there lived"


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]
    card = models.data[0].model_dump()  # vLLM's card: the model it serves, its context
    assert card["root"] == "SmolLM2-135M-Instruct.Q4_1" and card["parent"] is None
    assert card["max_model_len"] > 0


def test_chat_stream_joins_to_the_non_streamed_text(client):
    full = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=MESSAGES,
                                          temperature=0, max_tokens=32)
    choice = full.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(messages=MESSAGES, model=full.model,
                                                 temperature=0, max_tokens=32, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    """vLLM's stream option: each chunk's usage counts the tokens sent so far."""
    model = "SmolLM2-135M-Instruct.Q4_1"
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = list(client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                               max_tokens=8, stream=True,
                                               stream_options=options))
    text = list(client.completions.create(model=model, prompt=PROMPT, temperature=0,
                                          max_tokens=8, stream=True, stream_options=options))
    for chunks in (chat, text):
        done = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
        assert done == sorted(done) and done[-1] == 8 and done[-2] == 8 and done[0] <= 1
        assert chunks[-1].choices == []  # the include_usage chunk still ends the stream


def test_continue_final_message_goes_on_writing_it(client):
    model = "SmolLM2-135M-Instruct.Q4_1"
    whole = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                           max_tokens=32).choices[0].message.content
    start = " ".join(whole.split()[:3])  # the answer's own first words, prefilled
    prefilled = [*MESSAGES, {"role": "assistant", "content": start}]
    rest = client.chat.completions.create(
        model=model, messages=prefilled, temperature=0, max_tokens=32,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert start + rest.choices[0].message.content == whole  # no new turn: the same answer
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt=false"):
        client.chat.completions.create(model=model, messages=prefilled, max_tokens=2,
                                       extra_body={"continue_final_message": True})


def test_completion_stream_joins_to_the_non_streamed_text(client):
    full = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPT,
                                     temperature=0, max_tokens=24)
    stream = client.completions.create(model=full.model, prompt=PROMPT, temperature=0,
                                       max_tokens=24, stream=True)
    assert "".join(c.choices[0].text for c in stream) == full.choices[0].text
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 24
    # logprobs' text_offset counts from the text's start in every chunk (it began at 0 in each)
    kw = dict(model=full.model, prompt=PROMPT, temperature=0, max_tokens=8, logprobs=1)
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True)
              if c.choices and c.choices[0].logprobs]
    assert [o for lp in chunks for o in lp.text_offset] == whole.text_offset
    assert whole.text_offset[1:] == [whole.text_offset[i] + len(t)
                                     for i, t in enumerate(whole.tokens[:-1])]


def test_n_two_and_several_prompts(client):
    out = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=[PROMPT, "Hello"],
                                    n=2, temperature=1.0, seed=7, max_tokens=8)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=MESSAGES,
                                          n=2, temperature=1.0, seed=1, max_tokens=16)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content != chat.choices[1].message.content


def test_stop_strings(client):
    full = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPT,
                                     temperature=0, max_tokens=32).choices[0].text
    stop = full.split()[3]
    out = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPT,
                                    temperature=0, max_tokens=32, stop=[stop])
    assert out.choices[0].text == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop  # vLLM's: what stopped it
    streamed = list(client.completions.create(model="SmolLM2-135M-Instruct.Q4_1",
                                              prompt=PROMPT, temperature=0, max_tokens=32,
                                              stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    assert streamed[-1].choices[0].model_extra["stop_reason"] == stop
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=MESSAGES,
                                          temperature=0, max_tokens=32)
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].model_extra[
        "stop_reason"] is None  # the end of sequence: no stop string or stop token asked
    # A long stop string the text opens with: no piece of it is streamed before it matches.
    opening = full[:20]
    streamed = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPT,
                                         temperature=0, max_tokens=32, stop=[opening],
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == ""


def test_vllm_sampling_extras(client):
    model = "SmolLM2-135M-Instruct.Q4_1"
    full = client.completions.create(model=model, prompt=PROMPT, temperature=0,
                                     max_tokens=32).choices[0].text
    stop = full.split()[3]
    kept = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=32,
                                      stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:full.index(stop) + len(stop)]
    streamed = client.completions.create(model=model, prompt=PROMPT, temperature=0,
                                         max_tokens=32, stop=[stop], stream=True,
                                         extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in streamed) == kept.choices[0].text
    word = full.split()[1]
    banned = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=32,
                                       extra_body={"bad_words": [word]}).choices[0].text
    assert f" {word} " not in banned and banned != full
    # A chat answer run past its end-of-turn token shows the token only when asked to.
    answers = [client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=24,
        extra_body={"ignore_eos": True, "skip_special_tokens": skip}).choices[0].message.content
        for skip in (True, False)]
    assert "<|im_end|>" not in answers[0] and "<|im_end|>" in answers[1]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4,
                                  extra_body={"allowed_token_ids": [10**7]})
    assert info.value.body["param"] == "allowed_token_ids"


def test_usage_counts_the_prompt_tokens_read_from_the_cache(client):
    prompt = f"{uuid.uuid4().hex} " * 12 + PROMPT  # a prompt no test has cached
    runs = [client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt,
                                      temperature=0, max_tokens=2).usage for _ in range(2)]
    assert runs[0].prompt_tokens_details.cached_tokens == 0
    cached = runs[1].prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < runs[1].prompt_tokens  # whole blocks
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", temperature=0, max_tokens=2,
        messages=[{"role": "user", "content": prompt}]).usage
    assert chat.prompt_tokens_details.cached_tokens < chat.prompt_tokens


def test_logprobs(client):
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=MESSAGES,
                                          temperature=0, max_tokens=5, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy picks the top one
    comp = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPT,
                                     temperature=0, max_tokens=4, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == comp.choices[0].text


def test_tokenize_counts_what_chat_sends(client, server):
    import httpx

    def tokenize(**body) -> dict:
        r = httpx.post(f"{server.base_url}/tokenize", json={"messages": MESSAGES, **body},
                       headers=server.headers)
        assert r.status_code == 200, r.text
        return r.json()

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    for body in ({}, {"tools": [tool]}):
        sent = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1",
                                              messages=MESSAGES, max_tokens=1, **body)
        assert tokenize(**body)["count"] == sent.usage.prompt_tokens, body
    plain = tokenize()
    assert tokenize(add_generation_prompt=False)["count"] < plain["count"]
    strs = tokenize(return_token_strs=True)
    assert strs["tokens"] == plain["tokens"] and len(strs["token_strs"]) == plain["count"]
    assert strs["token_strs"][0] == "<|im_start|>"
    back = httpx.post(f"{server.base_url}/detokenize", json={"tokens": plain["tokens"]},
                      headers=server.headers).json()["prompt"]
    assert back.startswith("<|im_start|>") and back == "".join(strs["token_strs"]).replace(
        "Ġ", " ").replace("Ċ", "\n")  # special tokens and all, as vLLM's /detokenize


def test_echo_and_token_prompts(client, server):
    import httpx

    ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPT},
                     headers=server.headers).json()["tokens"]
    by_ids = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=ids,
                                       temperature=0, max_tokens=6, echo=True)
    by_text = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPT,
                                        temperature=0, max_tokens=6)
    assert by_ids.choices[0].text == PROMPT + by_text.choices[0].text
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids},
                      headers=server.headers).json()["prompt"]
    assert text == PROMPT


def test_echoed_offsets_run_on_and_echoed_ids_keep_their_special_tokens(client):
    """One run of text_offset over prompt and output tokens (a CJK character split over
    byte tokens spells the text otherwise); ids echo as they are, special tokens too."""
    kw = dict(model="SmolLM2-135M-Instruct.Q4_1", temperature=0, echo=True, logprobs=0,
              max_tokens=3)
    for prompt in ("中文：你好", [1, 4093, 198, 19556, 2]):  # <|im_start|>user\nHello<|im_end|>
        choice = client.completions.create(**kw, prompt=prompt).choices[0]
        lp = choice.logprobs
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i])
                                  for i in range(len(lp.tokens))]
    assert choice.text.startswith("<|im_start|>user\nHello<|im_end|>")


def test_echo_with_logprobs_scores_the_prompt(client, server):
    """OpenAI's scoring request (echo, logprobs, max_tokens 0: what lm-eval-harness sends):
    the prompt back with every token's logprob (the first null); with tokens to make, the
    same prompt part and then theirs; streamed alike; vLLM's prompt_logprobs field too."""
    import httpx

    kw = dict(model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPT, temperature=0, echo=True,
              logprobs=1)
    scored = client.completions.create(**kw, max_tokens=0)
    choice = scored.choices[0]
    lp = choice.logprobs
    assert choice.text == PROMPT and "".join(lp.tokens) == PROMPT
    assert scored.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert len(lp.tokens) == scored.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and lp.text_offset[:2] == [0, len(
        lp.tokens[0])]
    # the top one, and the prompt's own token where it ranks lower (OpenAI's, vLLM's)
    assert all(token in top and 1 <= len(top) <= 2
               for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    assert any(len(top) == 2 for top in lp.top_logprobs[1:])
    more = client.completions.create(**kw, max_tokens=2).choices[0]
    n = len(lp.tokens)
    assert more.logprobs.tokens[:n] == lp.tokens and len(more.logprobs.tokens) == n + 2
    assert more.logprobs.token_logprobs[1:n] == pytest.approx(lp.token_logprobs[1:], abs=1e-3)
    assert "".join(more.logprobs.tokens) == more.text
    chunks = list(client.completions.create(**kw, max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 1, "prompt_logprobs": 2}
    raw = httpx.post(f"{server.base_url}/v1/completions", json={**body, "prompt": PROMPT},
                     headers=server.headers, timeout=60).json()
    prompt_lps = raw["choices"][0]["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == raw["usage"]["prompt_tokens"]
    assert all(2 <= len(entry) <= 3 for entry in prompt_lps[1:])  # the token and the top 2
    chat_body = {**body, "messages": [{"role": "user", "content": "Hi"}]}
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat_body,
                      headers=server.headers, timeout=60).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    lines = httpx.post(f"{server.base_url}/v1/chat/completions", json={
        **chat_body, "stream": True}, headers=server.headers, timeout=60).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    carried = [c["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c]
    assert carried == [chat["prompt_logprobs"]]  # once, as the whole answer has them
    bad = httpx.post(f"{server.base_url}/v1/completions", json={**body, "prompt": PROMPT,
                     "prompt_logprobs": 21}, headers=server.headers, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_structured_outputs_through_every_request_field(client):
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "rank": {"type": "integer", "minimum": 1,
                                                        "maximum": 9}},
              "required": ["city", "rank"]}
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=MESSAGES, max_tokens=60, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    obj = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=MESSAGES,
                                         max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPT,
                                       max_tokens=10, extra_body={"guided_choice": ["a", "b"]})
    assert choice.choices[0].text in ("a", "b")
    regex = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=PROMPT,
                                      max_tokens=10, stream=True,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", "".join(c.choices[0].text for c in regex))
