"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob, rank and top
alternatives equal transformers' log-softmax over the same prompt, whatever the prefill's
chunking, a prefix cache that holds the prompt, or other requests in the batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pkv import LLM, SamplingParams

PROMPT = [100 + 7 * i for i in range(30)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> torch.Tensor:
    """transformers' log-softmax at every prompt position."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def _check(prompt_logprobs: list, reference: torch.Tensor, top_n: int) -> None:
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    for p in range(1, len(PROMPT)):
        entry, ref = prompt_logprobs[p], reference[p - 1]
        chosen = entry[PROMPT[p]]
        assert chosen.logprob == pytest.approx(float(ref[PROMPT[p]]), abs=1e-4)
        assert chosen.rank == int((ref > ref[PROMPT[p]]).sum()) + 1
        top = sorted((lp for lp in entry.values() if lp.rank <= top_n), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == list(range(1, top_n + 1))
        assert [lp.logprob for lp in top] == pytest.approx(ref.topk(top_n).values.tolist(),
                                                           abs=1e-4)


@pytest.mark.parametrize("chunk", [8, 2048])
def test_prompt_logprobs_equal_transformers(tiny_llama_dir: Path, reference: torch.Tensor,
                                            chunk: int):
    llm = LLM(str(tiny_llama_dir), show_progress=False, kv_cache_memory="8MiB",
              max_num_batched_tokens=chunk, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    first = llm.generate([PROMPT], params)[0]
    _check(first.prompt_logprobs, reference, 3)
    # Again with the prompt's blocks cached, beside a request that asks for none: the cache
    # gives no rows' logits, so this prompt is computed whole.
    again, other = llm.generate([PROMPT, PROMPT[:20]],
                                [params, SamplingParams(temperature=0, max_tokens=3)])
    assert again.num_cached_tokens == 0 and other.num_cached_tokens >= 16
    _check(again.prompt_logprobs, reference, 3)
    assert other.prompt_logprobs is None
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    two = llm.generate([PROMPT], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=2,
                                                prompt_logprobs=0))[0]
    assert len(two.outputs) == 2 and len(two.prompt_logprobs) == len(PROMPT)
    assert all(len(e) == 1 for e in two.prompt_logprobs[1:])  # the prompt token alone
    assert llm.llm_engine.get_stats().num_blocks_used == 0


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
