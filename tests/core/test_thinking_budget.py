"""A thinking budget: past `thinking_token_budget` tokens of thinking the engine writes the
end-of-thinking tokens itself, and what follows is the model's own continuation of that text
(token for token), in a batch, and under ngram speculation."""

from __future__ import annotations

import pytest

from pkv import LLM, SamplingParams
from pkv.core.sched.thinking_budget import ThinkingBudget

PROMPT = "Let me think about the number of legs of three spiders and two cats."


def _ids(llm: LLM, prompt: str | list[int], **kw) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 14), **kw)
    return llm.generate(prompt, params)[0].outputs[0].token_ids


def test_the_budget_closes_the_block_and_the_answer_follows(smol_llm: LLM):
    end = smol_llm.get_tokenizer().encode("</think>", add_special_tokens=False)
    assert len(end) > 1  # several tokens: forcing goes on until the marker is whole
    prompt = smol_llm.get_tokenizer().encode(PROMPT)
    free = _ids(smol_llm, prompt)
    capped = _ids(smol_llm, prompt, thinking_token_budget=5, think_end_token_ids=end)
    assert capped[:5] == free[:5] and capped[5:5 + len(end)] == end
    # After the marker: greedy on prompt + thought + marker, as if it had written them.
    head = capped[:5 + len(end)]
    assert capped[len(head):] == _ids(smol_llm, prompt + head,
                                      max_tokens=14 - len(head))
    # A block the model opens explicitly: an output that does not open it is left alone.
    other = [t for t in range(5, 9) if t != free[0]][:1]
    assert _ids(smol_llm, prompt, thinking_token_budget=2, think_start_token_ids=other,
                think_end_token_ids=end) == free
    # Batched with other requests, and under ngram speculation, the same tokens.
    batch = smol_llm.generate([prompt, PROMPT + " Twice.", prompt], [
        SamplingParams(temperature=0, max_tokens=14, thinking_token_budget=5,
                       think_end_token_ids=end),
        SamplingParams(temperature=0, max_tokens=14),
        SamplingParams(temperature=0, max_tokens=14, thinking_token_budget=0,
                       think_end_token_ids=end)])
    assert batch[0].outputs[0].token_ids == capped
    assert batch[2].outputs[0].token_ids[:len(end)] == end


def test_a_forced_token_reports_its_own_logprob(smol_llm: LLM):
    """The end marker's tokens come with their own logprobs and ranks (those the model gave
    them, as prompt_logprobs of the same text read them), not the sampled tokens'."""
    end = smol_llm.get_tokenizer().encode("</think>", add_special_tokens=False)
    prompt = smol_llm.get_tokenizer().encode(PROMPT)
    out = smol_llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=5 + len(end), logprobs=2, thinking_token_budget=5,
        think_end_token_ids=end))[0].outputs[0]
    assert out.token_ids[5:] == end
    read = smol_llm.generate([prompt + out.token_ids], SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs[len(prompt):]
    for token, entry, truth in zip(out.token_ids, out.logprobs, read):
        assert entry[token].logprob == pytest.approx(truth[token].logprob, abs=1e-3)
        assert entry[token].rank == truth[token].rank
    assert [entry[t].rank for t, entry in zip(end, out.logprobs[5:])] != [1] * len(end)


def test_a_budget_cannot_cut_into_a_constraint_from_the_first_token():
    from pkv.core.structured_output.params import StructuredOutputsParams as SO

    with pytest.raises(ValueError, match="needs structured_outputs.starts_after"):
        SamplingParams(thinking_token_budget=4, think_end_token_ids=[7],
                       structured_outputs=SO(json_object=True))
    SamplingParams(thinking_token_budget=4, think_end_token_ids=[7],
                   structured_outputs=SO(json_object=True, starts_after="</think>"))


def test_under_ngram_speculation(smol_llm: LLM):
    spec = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4},
               kv_cache_memory="64MiB", max_model_len=256, show_progress=False)
    end = spec.get_tokenizer().encode("</think>", add_special_tokens=False)
    repeat = "one two three four five one two three four five one two three four"
    prompt = spec.get_tokenizer().encode(repeat)
    want = _ids(smol_llm, prompt, max_tokens=20, thinking_token_budget=6,
                think_end_token_ids=end)
    assert _ids(spec, prompt, max_tokens=20, thinking_token_budget=6,
                think_end_token_ids=end) == want
    assert spec.llm_engine.spec_stats.num_draft_tokens > 0


def test_the_budget_follows_the_marker_at_the_tail():
    budget = ThinkingBudget(3, start=[], end=[7, 8])
    for token in (1, 7):
        assert budget.forced() is None
        budget.observe(token)
    budget.observe(2)  # the model broke its own marker off: three thinking tokens now
    assert budget.forced() == 7
    budget.observe(7)
    assert budget.forced() == 8
    budget.observe(8)
    assert budget.forced() is None and budget.phase == "done"


def test_a_budget_needs_the_end_tokens():
    with pytest.raises(ValueError, match="think_end_token_ids"):
        SamplingParams(thinking_token_budget=4)
    with pytest.raises(ValueError, match="thinking_token_budget must be >= 0"):
        SamplingParams(thinking_token_budget=-1, think_end_token_ids=[1])
