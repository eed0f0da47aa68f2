"""The offline API on the bundled model: chat, sampling options, stops, n>1, block hygiene."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkv import LLM, SamplingParams, TextPrompt, TokensPrompt

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def _text(llm: LLM, prompt: str | list[int], **kw) -> str:
    return llm.generate(prompt, SamplingParams(**kw))[0].outputs[0].text


def test_chat_answers_through_the_template(smol_llm: LLM):
    out = smol_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|>, not on length
    assert out.prompt_token_ids[:1] == [1]  # <|im_start|> from the template


def test_chat_takes_text_parts_and_tool_calls_as_the_server_does(smol_llm: LLM):
    greedy = SamplingParams(temperature=0, max_tokens=8)
    ask = "What is the capital of France?"
    plain = smol_llm.chat([{"role": "user", "content": "Be brief.\n" + ask}], greedy)[0]
    parts = smol_llm.chat([[{"role": "user", "content": [{"type": "text", "text": "Be brief."},
                                                          {"type": "text", "text": ask}]}]],
                          greedy)[0]  # text parts joined by newlines, as vLLM joins them
    assert parts.prompt_token_ids == plain.prompt_token_ids
    assert parts.outputs[0].token_ids == plain.outputs[0].token_ids
    called = [{"role": "user", "content": ask},
              {"role": "assistant", "content": None, "tool_calls": [{
                  "id": "c1", "type": "function",
                  "function": {"name": "capital", "arguments": '{"country": "France"}'}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "Paris"}]
    assert smol_llm.chat(called, greedy)[0].outputs[0].token_ids


@pytest.mark.parametrize("messages, message", [
    (None, "chat takes a conversation"),
    ({"role": "user", "content": "hi"}, "got dict"),
    ("hello", "got str"),
    ([{"content": "hi"}], "the conversation, message 0: role must be one of"),
    ([[{"role": "user", "content": "hi"}], "hi"], "conversation 1 is str"),
    ([{"role": "user", "content": None}], "a user message needs content"),
    ([{"role": "user", "content": 5}], "content must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "must be text parts"),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{bad"}}]}], "arguments must be a JSON object"),
])
def test_bad_conversations_name_the_message(smol_llm: LLM, messages: object, message: str):
    with pytest.raises(ValueError) as info:
        smol_llm.chat(messages)  # type: ignore[arg-type]
    assert message in str(info.value)
    assert smol_llm.llm_engine.get_stats().num_blocks_used == 0


def test_same_seed_same_output_whatever_the_batch(smol_llm: LLM):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=16)
    alone = smol_llm.generate([PROMPT], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12)
    batch = smol_llm.generate(["Hello", PROMPT, "Write a poem"], [others, params, others])
    assert batch[1].outputs[0].token_ids == alone
    different = smol_llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=124,
                                                           max_tokens=16))[0]
    assert different.outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(smol_llm: LLM):
    greedy = _text(smol_llm, PROMPT, temperature=0, max_tokens=16)
    assert _text(smol_llm, PROMPT, temperature=1.3, top_k=1, seed=5, max_tokens=16) == greedy


def test_stop_string_ends_text_before_it(smol_llm: LLM):
    full = _text(smol_llm, PROMPT, temperature=0, max_tokens=32, ignore_eos=True)
    words = full.split()
    stop = words[len(words) // 2]
    out = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32, stop=[stop]))
    completion = out[0].outputs[0]
    assert completion.text == full[:full.index(stop)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop


@pytest.mark.parametrize("params, message", [
    ({"temperature": 0}, "sampling_params takes a SamplingParams or a list of them, one per "
                         "prompt, not a dict"),
    ([None], "not a list of NoneType"),
    ("greedy", "not a str"),
])
def test_sampling_params_of_another_kind_are_named(smol_llm: LLM, params: object, message: str):
    with pytest.raises(TypeError, match=message):
        smol_llm.generate("Hi", params)  # type: ignore[arg-type]
    assert smol_llm.llm_engine.get_stats().num_blocks_used == 0


def test_a_temperature_too_small_to_divide_by_is_greedy(smol_llm: LLM):
    greedy = _text(smol_llm, PROMPT, temperature=0, max_tokens=8, ignore_eos=True)
    # 1e-40 is below float32's normal range: logits / it overflowed and sampled token 0
    assert _text(smol_llm, PROMPT, temperature=1e-40, max_tokens=8, ignore_eos=True,
                 seed=0) == greedy
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-4).greedy


def test_structured_outputs_as_a_dict_and_clone(smol_llm: LLM):
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs={"choice": ["yes",
                                                                                        "no"]})
    assert smol_llm.generate("Is the sky blue?", params)[0].outputs[0].text in ("yes", "no")
    copy = params.clone()
    copy.max_tokens = 9
    assert params.max_tokens == 4 and copy.structured_outputs == params.structured_outputs


def test_min_tokens_holds_back_stop_strings_too(smol_llm: LLM):
    full = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24,
                                                    ignore_eos=True))[0].outputs[0]
    tokenizer = smol_llm.get_tokenizer()
    first = tokenizer.decode(full.token_ids[:1])
    stop = first.strip()[:1]  # the first token's first character ends at once without it
    assert smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop])
                             )[0].outputs[0].token_ids == full.token_ids[:1]
    held = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                    min_tokens=3, ignore_eos=True))[0].outputs[0]
    # vLLM's rule: a stop string counts once min_tokens tokens exist, where it ends after them
    start = len(tokenizer.decode(full.token_ids[:3]))
    found = full.text.find(stop, start - len(stop) + 1)
    assert len(held.token_ids) >= 3 and held.text == (full.text[:found] if found >= 0
                                                      else full.text)


def test_cumulative_logprob_and_the_chat_prompt_text(smol_llm: LLM):
    out = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=1))
    completion = out[0].outputs[0]
    assert completion.cumulative_logprob == pytest.approx(
        sum(step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)))
    assert completion.cumulative_logprob < 0
    assert smol_llm.generate(PROMPT, SamplingParams(max_tokens=2))[0].outputs[0] \
        .cumulative_logprob is None
    chat = [{"role": "user", "content": "Hi"}]
    answer = smol_llm.chat(chat, SamplingParams(temperature=0, max_tokens=2))[0]
    assert answer.prompt == smol_llm.get_tokenizer().apply_chat_template(chat)
    assert answer.prompt_token_ids == smol_llm.get_tokenizer().apply_chat_template(
        chat, tokenize=True)  # transformers' keyword (it went to the template, unread)
    own = smol_llm.chat(chat, SamplingParams(temperature=0, max_tokens=2),
                        chat_template="{% for m in messages %}Q: {{ m['content'] }}\nA:"
                                      "{% endfor %}")[0]
    assert own.prompt == "Q: Hi\nA:" and own.prompt_token_ids == \
        smol_llm.get_tokenizer().encode("Q: Hi\nA:", add_special_tokens=False)
    with pytest.raises(ValueError, match="the chat template given does not compile"):
        smol_llm.chat(chat, chat_template="{% if %}")


@pytest.mark.parametrize("option, hint", [
    ("gpu_memory_utilization", "pkv calls it memory_utilization"),
    ("trust_remote_code", "runs no code from a checkpoint"),
])
def test_vllm_only_options_say_what_pkv_has(option: str, hint: str):
    with pytest.raises(ValueError, match=hint):
        LLM(**{option: True}, show_progress=False)


def test_stop_token_ids_and_min_tokens(smol_llm: LLM):
    greedy = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0]
    first = greedy.outputs[0].token_ids[0]
    stopped = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8,
                                                       stop_token_ids=[first]))[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    assert stopped.stop_reason == first
    held = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, min_tokens=4,
                                                    stop_token_ids=[first]))[0].outputs[0]
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]


def test_the_stop_token_or_string_stays_out_of_the_text_unless_asked(smol_llm: LLM):
    greedy = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0]
    ids, text = greedy.outputs[0].token_ids, greedy.outputs[0].text
    tokenizer = smol_llm.get_tokenizer()
    for include in (False, True):
        out = smol_llm.generate(PROMPT, SamplingParams(
            temperature=0, max_tokens=8, stop_token_ids=[ids[2]],
            include_stop_str_in_output=include))[0].outputs[0]
        assert out.token_ids == ids[:3] and out.stop_reason == ids[2]  # the id stays
        assert out.text == tokenizer.decode(ids[:3] if include else ids[:2])
    stop = tokenizer.decode(ids[3:5]).strip()
    kept = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, stop=[stop],
                                                    include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == text[:text.index(stop) + len(stop)]
    assert smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, stop=[stop])
                             )[0].outputs[0].text == text[:text.index(stop)]


def test_allowed_token_ids_and_bad_words(smol_llm: LLM):
    greedy = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    allowed = greedy.token_ids[1:4]
    only = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8,
                                                    allowed_token_ids=allowed))[0].outputs[0]
    assert set(only.token_ids) <= set(allowed) and only.token_ids != greedy.token_ids
    sampled = smol_llm.generate(PROMPT, SamplingParams(temperature=1.5, seed=1, max_tokens=12,
                                                       allowed_token_ids=allowed))[0]
    assert set(sampled.outputs[0].token_ids) <= set(allowed)
    word = greedy.text.split()[1]  # " wise": a word the greedy text has
    tokenizer = smol_llm.get_tokenizer()
    banned = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8,
                                                      bad_words=[word]))[0].outputs[0]
    spaced = tokenizer.encode(" " + word, add_special_tokens=False)
    assert banned.token_ids[:1] == greedy.token_ids[:1] and banned.token_ids != greedy.token_ids
    assert all(banned.token_ids[i:i + len(spaced)] != spaced for i in range(len(banned.token_ids)))
    with pytest.raises(ValueError, match="allowed_token_ids must be in"):
        smol_llm.generate(PROMPT, SamplingParams(allowed_token_ids=[10**7]))
    with pytest.raises(ValueError, match="bad_words must be a list of non-empty strings"):
        SamplingParams(bad_words=[" "])
    with pytest.raises(ValueError, match="include_stop_str_in_output must be true or false"):
        SamplingParams(include_stop_str_in_output="yes")  # type: ignore[arg-type]
    assert smol_llm.llm_engine.get_stats().num_blocks_used == 0


def test_max_tokens_gives_length(smol_llm: LLM):
    out = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5,
                                                   ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_n_samples_share_prompt_blocks(smol_llm: LLM):
    engine = smol_llm.llm_engine
    prompt = smol_llm.get_tokenizer().encode(PROMPT * 3)  # several full blocks
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    engine.add_request("n2", prompt, params)
    engine.step()
    a, b = (engine.kv_cache.block_ids(f"n2#{i}")[0] for i in range(2))
    full = (len(prompt) - 1) // engine.config.block_size
    assert full >= 2 and a[:full] == b[:full] and a[-1] != b[-1]
    finals = engine.generate_until_done()
    (out,) = [o for o in finals if o.request_id == "n2"]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    assert engine.get_stats().num_blocks_used == 0


def test_logprobs_cover_every_token(smol_llm: LLM):
    out = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=3))
    completion = out[0].outputs[0]
    assert len(completion.logprobs) == 4
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert entry[token].rank == 1 and entry[token].logprob <= 0  # greedy: the top token
        assert len(entry) == 3


def test_blocks_return_after_finish_and_abort(smol_llm: LLM):
    engine = smol_llm.llm_engine
    for i in range(6):
        engine.add_request(f"leak{i}", PROMPT + " " * i, SamplingParams(max_tokens=40,
                                                                        ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.get_stats().num_blocks_used > 0
    aborted = engine.abort_request(["leak0", "leak3"])
    assert [o.outputs[0].finish_reason for o in aborted] == ["abort", "abort"]
    finals = engine.generate_until_done()
    assert {o.request_id for o in finals} == {"leak1", "leak2", "leak4", "leak5"}
    stats = engine.get_stats()
    assert stats.num_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


@pytest.mark.parametrize("prompt,params,message", [
    ("", SamplingParams(), "prompt must not be empty"),
    ([], SamplingParams(), "prompt must not be empty"),
    ("hi " * 600, SamplingParams(), "max_model_len"),
    ([10**9], SamplingParams(), "token ids"),
    ({"prompt": [1, 2]}, SamplingParams(), "prompt must be a string"),
    (None, SamplingParams(), "a prompt is a string, a list of token ids or a prompt dict"),
    ({"prompt_token_ids": "abc"}, SamplingParams(), "prompt_token_ids must be a list"),
    ({"prompt": "a", "prompt_token_ids": [1]}, SamplingParams(), "exactly one of prompt"),
    ({"prompt": "a", "multi_modal_data": {}}, SamplingParams(), "not multi_modal_data"),
    ([True, 5], SamplingParams(), "token ids must be integers"),
    ("x\ud800", SamplingParams(), "not valid Unicode: a lone surrogate"),
    # nothing left to sample: token 0 came out, allowed or not
    ("Hi", SamplingParams(allowed_token_ids=[28], bad_words=[","]), "every allowed token is"),
    ("Hi", SamplingParams(allowed_token_ids=[2], min_tokens=2), "every allowed token is banned"),
])
def test_bad_prompts_raise_before_any_work(smol_llm: LLM, prompt, params, message):
    engine = smol_llm.llm_engine
    with pytest.raises(ValueError, match=message):
        smol_llm.generate([PROMPT, prompt], params)
    assert not engine.has_unfinished_requests()  # the good prompt was withdrawn too
    assert engine.get_stats().num_blocks_used == 0
    assert _text(smol_llm, "Hello", temperature=0, max_tokens=3)  # still serving


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n must"),
    ({"min_p": 2.0}, "min_p"),
    ({"logprobs": 50}, "logprobs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    # wrong types are refused here, not deep in a step (a float logprobs broke topk)
    ({"logprobs": 2.5}, "logprobs must be an integer"),
    ({"max_tokens": "3"}, "max_tokens must be an integer"),
    ({"n": True}, "n must be an integer"),
    ({"temperature": "1"}, "temperature must be a number"),
    ({"stop": 5}, "stop must be a string"),
    ({"think_end_token_ids": [1.5]}, "think_end_token_ids must be a list of token ids"),
    ({"structured_outputs": {"choice": ["a"], "grammar": "x"}}, "structured_outputs takes"),
    ({"structured_outputs": "yes|no"}, "structured_outputs must be"),
])
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_truncate_prompt_tokens_keeps_the_last_tokens(smol_llm: LLM):
    """Ids keep their last N; a text its last N - 1 after the BOS the tokenizer puts first
    (as a tokenizer truncating on the left); -1 leaves max_tokens of max_model_len free."""
    tok = smol_llm.get_tokenizer()
    greedy = dict(temperature=0, max_tokens=4)
    ids = tok.encode(PROMPT)
    cut = smol_llm.generate([ids], SamplingParams(**greedy, truncate_prompt_tokens=5))[0]
    assert cut.prompt_token_ids == ids[-5:]
    assert cut.outputs[0].token_ids == smol_llm.generate(
        [ids[-5:]], SamplingParams(**greedy))[0].outputs[0].token_ids
    text = smol_llm.generate(PROMPT, SamplingParams(**greedy, truncate_prompt_tokens=5))[0]
    body = tok.encode(PROMPT, add_special_tokens=False)
    assert text.prompt_token_ids == ids[:len(ids) - len(body)] + body[-(5 - len(ids) +
                                                                         len(body)):]
    assert len(text.prompt_token_ids) == 5
    limit = smol_llm.llm_engine.max_model_len
    fitted = smol_llm.generate([[7] * (limit + 50)], SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, truncate_prompt_tokens=-1))[0]
    assert len(fitted.prompt_token_ids) == limit - 3 and len(fitted.outputs[0].token_ids) == 3


def test_max_tokens_past_max_model_len_stops_there(smol_llm: LLM):
    """Offline, as vLLM's LLM: the output ends at max_model_len ("length"), where the
    server refuses the request (OpenAI's rule)."""
    limit = smol_llm.llm_engine.max_model_len
    out = smol_llm.generate([[7] * (limit - 4)], SamplingParams(
        temperature=0, max_tokens=600, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    assert smol_llm.llm_engine.get_stats().num_blocks_used == 0


@pytest.mark.parametrize("prompts", [None, 5, b"hello"])
def test_prompts_of_no_kind_are_refused(smol_llm: LLM, prompts: object):
    with pytest.raises(ValueError, match="prompts are a string, token ids"):
        smol_llm.generate(prompts)  # type: ignore[arg-type]


def test_a_failed_or_interrupted_call_leaves_nothing_running(smol_llm: LLM):
    """A token id outside the vocabulary is refused before any work; a step that fails (or
    a Ctrl-C) ends the call's requests, so the next call runs alone and no block is held."""
    engine = smol_llm.llm_engine
    with pytest.raises(ValueError, match="think_end_token_ids must be in"):
        smol_llm.generate(PROMPT, SamplingParams(thinking_token_budget=0,
                                                 think_end_token_ids=[10**9]))
    calls = 0
    step = engine.step

    def interrupted():  # noqa: ANN202
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            smol_llm.generate([PROMPT] * 4, SamplingParams(max_tokens=400, ignore_eos=True))
    finally:
        del engine.step
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().num_blocks_used == 0
    assert _text(smol_llm, "Hello", temperature=0, max_tokens=3)


def test_bfloat16_weights_run(tiny_llama_dir):
    import torch

    llm = LLM(str(tiny_llama_dir), dtype="bfloat16", kv_cache_memory="8MiB", show_progress=False)
    runner = llm.llm_engine.runner
    assert runner.dtype == torch.bfloat16 and runner.kv_cache.dtype == torch.bfloat16
    assert next(runner.model.parameters()).dtype == torch.bfloat16
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6,
                                                      ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_vllm_prompt_dicts_are_prompts(smol_llm: LLM):
    greedy = SamplingParams(temperature=0, max_tokens=6)
    ids = smol_llm.get_tokenizer().encode(PROMPT)
    plain = smol_llm.generate([PROMPT, ids], greedy)
    dicts = smol_llm.generate([TextPrompt(prompt=PROMPT), TokensPrompt(prompt_token_ids=ids)],
                              greedy)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[0].prompt == PROMPT and dicts[1].prompt_token_ids == ids
    one = smol_llm.generate({"prompt_token_ids": ids}, greedy)  # a single dict is one prompt
    assert len(one) == 1 and one[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
    # A dict's cache_salt keeps its blocks apart: the same long prompt under another salt
    # computes its prefix again instead of reading the unsalted one's blocks.
    long_ids = smol_llm.get_tokenizer().encode(" ".join([PROMPT] * 4))  # full blocks
    smol_llm.generate([long_ids], greedy)
    salted = smol_llm.generate({"prompt_token_ids": long_ids, "cache_salt": "tenant-x"}, greedy)
    again = smol_llm.generate({"prompt_token_ids": long_ids, "cache_salt": "tenant-x"}, greedy)
    assert salted[0].num_cached_tokens == 0 and again[0].num_cached_tokens >= 48


def test_no_cache_salt_spells_the_engines_own(smol_llm: LLM):
    """A client's salt is kept apart from the parts the engine adds (LongRoPE's long table,
    an adapter): one spelling "\0longrope" does not take the blocks of the long table."""
    from pkv.core.sched.scheduler import LONG_ROPE_SALT

    engine = smol_llm.llm_engine
    ids = smol_llm.get_tokenizer().encode(" ".join([PROMPT] * 4))
    [long_table] = engine.prepare_request(None, ids, SamplingParams()).children
    long_table.resalt(LONG_ROPE_SALT)
    [spelled] = engine.prepare_request(None, ids, SamplingParams(),
                                       cache_salt=LONG_ROPE_SALT.decode()).children
    assert long_table.block_hashes and not set(spelled.block_hashes) & set(
        long_table.block_hashes)


def test_a_request_an_idle_engine_cannot_place_fails_instead_of_waiting(smol_llm: LLM):
    engine = smol_llm.llm_engine
    pool = engine.kv_cache.pool
    pool.reset_prefix_cache()
    held = pool.allocate(pool.num_free_blocks - 1)  # blocks nobody will give back soon
    try:
        engine.add_request("stuck", PROMPT * 4, SamplingParams(max_tokens=4))
        (out,) = engine.step()
        assert out.request_id == "stuck" and out.finished
        assert "does not fit in the KV cache: 1 of" in out.error
        assert not engine.has_unfinished_requests()
    finally:
        pool.free(held)
    assert engine.get_stats().num_blocks_used == 0
    assert _text(smol_llm, "Hello", temperature=0, max_tokens=3)  # still serving


def test_a_kv_pool_past_the_machines_memory_is_a_one_line_error(tiny_llama_dir: Path):
    with pytest.raises(ValueError, match="more than this cpu device's memory") as caught:
        LLM(str(tiny_llama_dir), kv_cache_memory="1000TiB", show_progress=False)
    assert "\n" not in str(caught.value)


def test_unset_sampling_fields_take_the_models_generation_config(tmp_path: Path,
                                                                 tiny_llama_dir: Path):
    # vLLM's --generation-config auto: a model that asks for greedy decoding gets it from a
    # call that names no SamplingParams (it sampled at temperature 1.0 regardless).
    import json
    import shutil

    from pkv.core.server.protocol import ChatCompletionRequest

    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "temperature": 0.0, "top_k": 5, "repetition_penalty": 1.3,
         "top_p": "high"}))  # (a value of the wrong type is skipped)
    llm = LLM(str(model), kv_cache_memory="8MiB", show_progress=False)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.repetition_penalty,
            defaults.top_p) == (0.0, 5, 1.3, 1.0)
    prompt = [[5, 6, 7, 8, 9]]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, repetition_penalty=1.3,
                                                 max_tokens=defaults.max_tokens))
    assert [o.outputs[0].token_ids for o in llm.generate(prompt * 2)] == \
        [greedy[0].outputs[0].token_ids] * 2
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_k=3)
    served = body.sampling_params(None, None, None, llm.llm_engine.sampling_defaults)
    assert (served.temperature, served.top_k, served.repetition_penalty) == (0.0, 3, 1.3)
    plain = LLM(str(model), kv_cache_memory="8MiB", show_progress=False,
                generation_config="none")
    assert plain.get_default_sampling_params().temperature == 1.0


def test_offline_misuses_are_one_line_errors(smol_llm: LLM, tiny_llama_dir: Path):
    from pkv import PoolingParams

    chat = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="may not set 'bos_token'"):
        smol_llm.chat(chat, chat_template_kwargs={"bos_token": "x"})
    # vLLM merges these over the arguments
    quiet = smol_llm.chat(chat, SamplingParams(max_tokens=1),
                          chat_template_kwargs={"add_generation_prompt": False})[0]
    assert not quiet.prompt.endswith("assistant\n")
    with pytest.raises(TypeError):  # (vLLM's 5th positional argument is the template)
        smol_llm.chat(chat, None, None, None, "{{ messages }}")  # type: ignore[misc]
    with pytest.raises(ValueError, match="the chat template refused these messages"):
        smol_llm.chat(chat, chat_template="{{ raise_exception('no thanks') }}")
    with pytest.raises(TypeError, match="lora_request takes a LoRARequest"):
        LLM(str(tiny_llama_dir), kv_cache_memory="8MiB", show_progress=False,
            enable_lora=True).generate("hi", lora_request="a")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="one PoolingParams for every pair"):
        smol_llm.score("a", ["b", "c"], pooling_params=[PoolingParams()])  # type: ignore
    for bad in (dict(normalize="false"), dict(activation="no"), dict(dimensions=True)):
        with pytest.raises(ValueError):
            PoolingParams(**bad)
    assert smol_llm.llm_engine.get_stats().num_blocks_used == 0


def test_a_text_longer_than_any_prompt_is_refused_before_tokenizing(smol_llm: LLM):
    # No token covers more characters than the longest vocabulary entry: past that bound the
    # text cannot fit, and tokenizing megabytes of it first cost seconds of CPU.
    from pkv.core.engine.input_processor import ContextLengthError

    engine = smol_llm.llm_engine
    most = engine.max_model_len * engine.tokenizer.max_token_chars
    assert 4 <= engine.tokenizer.max_token_chars < 100
    calls = []
    real = engine.tokenizer.encode
    engine.tokenizer.encode = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        with pytest.raises(ContextLengthError, match="characters, more than max_model_len"):
            smol_llm.generate("a" * (most + 1), SamplingParams(max_tokens=1))
        assert not calls
        # truncated to its last tokens, it is served
        kept = smol_llm.generate("a " * (most // 2 + 1), SamplingParams(
            max_tokens=1, truncate_prompt_tokens=8))[0]
        assert len(kept.prompt_token_ids) <= 9
    finally:
        del engine.tokenizer.encode
