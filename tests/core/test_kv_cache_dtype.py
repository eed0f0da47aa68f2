"""`kv_cache_dtype`: the pool holds more blocks in the same memory, greedy output stays that of
a float32 cache (exact, or a near tie at the first difference), and the engine's machinery
(batching, preemption, prefix caching, speculation, tensor parallelism) works unchanged on
top. A row's codes and scale depend on that row alone, but a K value computed by another
path (a batch's GEMM, a recomputing prefill) may differ in its last bits and round to the
next code: so those runs too are held to "exact, or a near tie"."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pkv import LLM, SamplingParams
from pkv.core.config.engine import EngineConfig
from pkv.core.layers.kv_format import kv_format
from pkv.tests.conftest import PROMPTS

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _greedy(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def int8_llm() -> LLM:
    return LLM(kv_cache_dtype="int8", kv_cache_memory="32MiB", max_model_len=512,
               show_progress=False)


def test_the_same_memory_holds_more_blocks(smol_llm: LLM, int8_llm: LLM) -> None:
    base = smol_llm.llm_engine.runner
    budget = 32 * 2**20
    f32_blocks = budget // base.kv_bytes_per_block
    assert int8_llm.llm_engine.runner.num_blocks / f32_blocks >= 1.9
    # SmolLM2: 30 layers, 3 KV heads of 64 -> 16 tokens take 30 x 2 x 16 x 3 x 68 bytes.
    assert int8_llm.llm_engine.runner.kv_bytes_per_block == 30 * 2 * 16 * 3 * 68
    assert int8_llm.llm_engine.runner.kv_cache.dtype == torch.int8


WITH_LOGPROBS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)


def _assert_same_or_near_tie(reference: LLM, prompts: list, got: list[list[int]],
                             most_differing: int = 2) -> None:
    """Each of `got` is `reference`'s greedy output, or leaves it where the reference's top
    two candidates were within 0.1 of probability."""
    differing = 0
    for ref, ids in zip(reference.generate(prompts, WITH_LOGPROBS), got):
        want = ref.outputs[0].token_ids
        if ids == want:
            continue
        differing += 1
        i = next(j for j, (a, b) in enumerate(zip(ids, want)) if a != b)
        top = ref.outputs[0].logprobs[i]  # the reference's candidates where `got` went its way
        assert ids[i] in top, (i, ids[i], top)
        assert math.exp(top[want[i]].logprob) - math.exp(top[ids[i]].logprob) < 0.1
    assert differing <= most_differing


def test_int8_greedy_matches_float32_or_differs_at_a_near_tie(smol_llm: LLM,
                                                              int8_llm: LLM) -> None:
    _assert_same_or_near_tie(smol_llm, PROMPTS, _greedy(int8_llm, PROMPTS))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_caches_hold_twice_the_blocks_and_keep_greedy_output(smol_llm: LLM,
                                                                     dtype: str) -> None:
    llm = LLM(kv_cache_dtype=dtype, kv_cache_memory="32MiB", max_model_len=512,
              show_progress=False)
    runner = llm.llm_engine.runner
    assert runner.kv_bytes_per_block * 2 == smol_llm.llm_engine.runner.kv_bytes_per_block
    assert runner.kv_cache.dtype == getattr(torch, dtype)
    _assert_same_or_near_tie(smol_llm, PROMPTS, _greedy(llm, PROMPTS))


def test_batching_preemption_and_prefix_caching_on_an_int8_cache(int8_llm: LLM) -> None:
    prompts = PROMPTS[:6]
    # A pool of 12 blocks (4 sequences' worth at most): requests preempt and recompute, and
    # the shared prefix below hits the cache.
    tight = LLM(kv_cache_dtype="int8", kv_cache_memory=12 * 30 * 2 * 16 * 3 * 68,
                max_model_len=192, max_num_seqs=6, show_progress=False)
    _assert_same_or_near_tie(int8_llm, prompts, _greedy(tight, prompts))
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert tight.llm_engine.kv_cache.pool.num_used_blocks == 0  # nothing leaked
    shared = "You are a helpful assistant. Answer in one short sentence please. "
    pair = [shared + "What is the sun?", shared + "What is the moon?"]
    _greedy(tight, pair[:1])
    hits = tight.llm_engine.kv_cache.prefix_hits
    _assert_same_or_near_tie(int8_llm, pair, _greedy(tight, pair), most_differing=0)
    assert tight.llm_engine.kv_cache.prefix_hits > hits


def test_a_hybrid_model_keeps_its_groups_on_an_int8_cache(tmp_path: Path,
                                                          smol_hf_dir: Path) -> None:
    from pkv.core.worker.kv_pool_size import blocks_per_seq
    from pkv.tests.helpers import build_tiny_model, parity_prompts

    # Gemma 2's alternation, window 8: a global group and a windowed one share the pool.
    model = build_tiny_model(tmp_path / "gemma2", smol_hf_dir, "gemma2", head_dim=32,
                             sliding_window=8, num_hidden_layers=2, query_pre_attn_scalar=24)
    prompts = parity_prompts()
    roomy = LLM(str(model), kv_cache_dtype="int8", kv_cache_memory="8MiB", max_model_len=96,
                show_progress=False)
    assert len(roomy.llm_engine.runner.kv_groups.groups) == 2
    want = _greedy(roomy, prompts)
    runner = roomy.llm_engine.runner
    # what one sequence may hold at once, in steps of 16
    least = blocks_per_seq(runner.config, runner.kv_groups, 96)
    tight = LLM(str(model), kv_cache_dtype="int8", max_model_len=96, block_size=16,
                max_num_batched_tokens=16, kv_cache_memory=least * runner.kv_bytes_per_block,
                show_progress=False)
    _assert_same_or_near_tie(roomy, prompts, _greedy(tight, prompts))
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert tight.llm_engine.kv_cache.pool.num_used_blocks == 0
    tight.generate(prompts[-1:], GREEDY)
    again = tight.generate(prompts[-1:], GREEDY)[0]  # every group's blocks of it hit
    assert again.num_cached_tokens >= 64 and again.outputs[0].token_ids == want[-1]


def test_speculative_decoding_on_an_fp8_cache_keeps_greedy_tokens() -> None:
    prompt = "one two three four five one two three four five one two three four"
    plain = LLM(kv_cache_dtype="fp8_e4m3", kv_cache_memory="32MiB", max_model_len=256,
                show_progress=False)
    spec = LLM(kv_cache_dtype="fp8", kv_cache_memory="32MiB", max_model_len=256,
               show_progress=False, speculative_config={
                   "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 3})
    assert spec.llm_engine.runner.kv_format.name == "fp8_e4m3"
    _assert_same_or_near_tie(plain, [prompt], _greedy(spec, [prompt]))
    assert spec.llm_engine.spec_stats.num_accepted_tokens > 0


def test_tensor_parallel_ranks_hold_their_heads_in_int8(tiny_qwen2_dir: Path) -> None:
    prompts = [[1, 2, 3, 4], list(range(200, 260)), [7] * 9]
    one = LLM(str(tiny_qwen2_dir), kv_cache_dtype="int8", kv_cache_memory="16MiB",
              max_model_len=256, show_progress=False)
    expected = _greedy(one, prompts)
    two = LLM(str(tiny_qwen2_dir), kv_cache_dtype="int8", tensor_parallel_size=2,
              kv_cache_memory="16MiB", max_model_len=256, show_progress=False)
    try:
        assert _greedy(two, prompts) == expected
    finally:
        two.shutdown()


def test_bad_kv_cache_dtypes_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="multiple of 4, this model's is 6"):
        kv_format("int8", torch.float32, 6)
    assert kv_format("auto", torch.bfloat16, 64).name == "bfloat16"
    assert kv_format("fp8", torch.float32, 64).row_bytes == 68
