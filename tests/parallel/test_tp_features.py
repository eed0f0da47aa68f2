"""What runs on top of tensor parallelism: LoRA adapters (each rank holds its slices of every
pair: B's rows of a column-parallel linear's outputs, A's columns of a row-parallel one's
inputs, whose partial deltas the layer's all-reduce sums), speculative decoding (the driver
drafts and verifies; the ranks run the verify step as any other; under pipeline parallelism
too) and the KV disk tier (a file holds every rank's part of a block). Greedy tokens equal
one rank's."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkv import LLM, SamplingParams
from pkv.tests.conftest import PROMPTS
from pkv.tests.core.test_kv_offload import DOC_LEN, _prompts, _run
from pkv.tests.core.test_lora import _adapters
from pkv.tests.core.test_spec_decode import COPY, NGRAM
from pkv.tests.helpers import build_tiny_model, kv_block_bytes

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPT_IDS = [[1, 2, 3, 4], list(range(200, 260)), [7] * 9, list(range(300, 341))]


def _greedy(llm: LLM, prompts: list, **kwargs) -> list[list[int]]:  # noqa: ANN001, ANN003
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, **kwargs)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("parallel", [
    dict(tensor_parallel_size=2),
    dict(pipeline_parallel_size=2, pp_layer_partition="1,3"),
    dict(tensor_parallel_size=2, pipeline_parallel_size=2, pp_layer_partition="1,3")])
def test_adapters_under_a_split_equal_one_rank(parallel: dict, tmp_path: Path,
                                               smol_hf_dir: Path) -> None:
    """Two adapters and none in one batch, one slot between them (refilled while others
    wait, under PP while another micro-batch is in flight): each rank loads its slices of the
    pairs of its own layers from the step that brings them."""
    model = build_tiny_model(tmp_path / "llama", smol_hf_dir, "llama", num_hidden_layers=4)
    adapters = _adapters(model, tmp_path)
    loras = [[None, adapters[0][0], adapters[1][0]][i % 3] for i in range(6)]
    prompts = [PROMPT_IDS[i % 4] + [i] for i in range(6)]
    options = dict(max_model_len=128, block_size=4, kv_cache_memory="4MiB", enable_lora=True,
                   max_loras=1, max_lora_rank=8, show_progress=False)
    expected = _greedy(LLM(str(model), **options), prompts, lora_request=loras)
    assert expected[1] != _greedy(LLM(str(model), **options), [prompts[1]])[0]
    split = LLM(str(model), **options, **parallel)
    engine = split.llm_engine
    # The driver checks adapters against whole linears of every stage, not its slices.
    targets = engine.lora.targets
    assert targets["model.layers.0.self_attn.qkv_proj"].out_sizes == (64, 32, 32)
    assert targets["model.layers.3.mlp.down_proj"].in_features == 128
    pipelined = "pipeline_parallel_size" in parallel
    assert ("model.layers.3.mlp.down_proj" in engine.runner.lora_layers) != pipelined
    assert _greedy(split, prompts, lora_request=loras) == expected
    assert engine.get_stats().num_blocks_used == 0


def test_an_adapter_for_another_model_is_refused_under_tp(tmp_path: Path,
                                                          smol_hf_dir: Path) -> None:
    """An adapter whose pairs are half the width (a model half this one's size) is not taken
    for one rank's slice: the whole linear is what it must fit."""
    model = build_tiny_model(tmp_path / "llama", smol_hf_dir, "llama")
    narrow = build_tiny_model(tmp_path / "narrow", smol_hf_dir, "llama", intermediate_size=64)
    adapters = _adapters(narrow, tmp_path)
    llm = LLM(str(model), tensor_parallel_size=2, max_model_len=64, kv_cache_memory="4MiB",
              enable_lora=True, max_lora_rank=8, show_progress=False)
    try:
        with pytest.raises(ValueError, match="do not fit the model's projection"):
            llm.generate([[1, 2, 3]], GREEDY, lora_request=adapters[0][0])
        assert llm.llm_engine.get_stats().num_blocks_used == 0
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids) == 16
    finally:
        llm.shutdown()


# Pool sizes in (target + draft) blocks that force preemption: a TP rank's block holds half
# the target's KV heads, a stage's its layers (the driver's also the draft's).
@pytest.mark.parametrize(("split", "pool_blocks"), [("tensor_parallel_size", 20),
                                                   ("pipeline_parallel_size", 24)])
def test_speculation_under_a_split_keeps_the_greedy_tokens(split: str, pool_blocks: int,
                                                           smol_llm: LLM, tmp_path: Path,
                                                           tiny_qwen2_dir: Path,
                                                           smol_hf_dir: Path) -> None:
    """The driver drafts and verifies (under PP a micro-batch's drafts before it is launched,
    verified when its rows come back): prompt lookup on the bundled model, and a draft model
    that mostly disagrees (rollbacks) on a tiny Qwen2 whose pool forces preemption."""
    params = SamplingParams(temperature=0, max_tokens=40)
    prompts = [COPY, *PROMPTS[:3]]
    expected = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]
    two = LLM(kv_cache_memory="64MiB", max_model_len=512, speculative_config=NGRAM,
              show_progress=False, **{split: 2})
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, params)] == expected
        assert two.llm_engine.spec_stats.num_accepted_tokens > 20
        assert two.llm_engine.get_stats().num_blocks_used == 0
    finally:
        two.shutdown()
    draft = build_tiny_model(tmp_path / "draft", smol_hf_dir, "llama", hidden_size=32,
                             num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=64)
    options = dict(max_model_len=128, block_size=4, max_num_batched_tokens=16,
                   show_progress=False)
    expected = _greedy(LLM(str(tiny_qwen2_dir), kv_cache_memory="1MiB", **options), PROMPT_IDS)
    spec = {"model": str(draft), "num_speculative_tokens": 3}
    per_block = kv_block_bytes(tiny_qwen2_dir, 4)[0] + kv_block_bytes(draft, 4, True)[0]
    two = LLM(str(tiny_qwen2_dir), speculative_config=spec,
              kv_cache_memory=pool_blocks * per_block, **options, **{split: 2})
    engine = two.llm_engine
    assert _greedy(two, PROMPT_IDS) == expected
    assert engine.spec_stats.num_draft_tokens > 0  # (all rejected: a random draft)
    assert engine.scheduler.num_preemptions > 0


def _offload_engine(model_dir: Path, offload: Path | None, tp: int = 1, pp: int = 1):  # noqa: ANN202
    """An LLMEngine whose pool holds about two documents (16 blocks), so documents evict
    each other."""
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm_engine import LLMEngine

    heads = 3 if tp == 1 else 2  # of the rank with the most
    layers = 2 // pp
    # the rank's layers, K and V, 16 slots, the heads, rows of 16 float32
    config = EngineConfig(model=str(model_dir),
                          kv_cache_memory=16 * layers * 2 * 16 * heads * 64,
                          max_model_len=200, max_num_seqs=1, tensor_parallel_size=tp,
                          pipeline_parallel_size=pp,
                          kv_offload_dir=str(offload) if offload else None)
    return LLMEngine(config, show_progress=False)


@pytest.mark.parametrize("tp,pp,sizes", [(2, 1, [8192, 4096]), (1, 2, [6144, 6144]),
                                         (2, 2, [4096, 2048, 4096, 2048])])
def test_the_kv_disk_tier_under_a_split_keeps_every_ranks_part(
        tp: int, pp: int, sizes: list[int], tmp_path: Path, smol_hf_dir: Path) -> None:
    """Three KV heads over two ranks (parts of 2 and 1), two layers over two stages, or both:
    documents evicted from the pool come back from disk with one rank's greedy tokens, and
    after a restart too; a one-rank engine does not take the split's files (another
    layout)."""
    model = build_tiny_model(tmp_path / "m", smol_hf_dir, "llama", hidden_size=48,
                             num_attention_heads=3, num_key_value_heads=3)
    prompts = _prompts(num_docs=3, rounds=2)
    plain = _offload_engine(model, None)
    want = _run(plain, prompts)
    plain.shutdown()
    engine = _offload_engine(model, tmp_path / "kv", tp, pp)
    assert engine.runner.num_blocks == 16 and engine.runner.kv_parts.sizes == sizes
    try:
        assert _run(engine, prompts) == want
        stats = engine.get_stats().kv_offload
        assert stats.writes > 0 and stats.hits > 0 and stats.drops == 0
    finally:
        engine.shutdown()  # saves the blocks still in RAM, every rank's part
    first_id, first_prompt = prompts[0]
    restarted = _offload_engine(model, tmp_path / "kv", tp, pp)
    try:
        assert _run(restarted, [(first_id, first_prompt)]) == {first_id: want[first_id]}
        assert restarted.get_stats().kv_offload.hits == DOC_LEN // 16
    finally:
        restarted.shutdown()
    one = _offload_engine(model, tmp_path / "kv")
    try:
        assert _run(one, [(first_id, first_prompt)]) == {first_id: want[first_id]}
        assert one.get_stats().kv_offload.hits == 0
    finally:
        one.shutdown()


def test_the_kv_disk_tier_with_micro_batches_in_flight(tmp_path: Path,
                                                       smol_hf_dir: Path) -> None:
    """Two stages, requests side by side: blocks evicted and read back while other
    micro-batches are in the pipeline keep one rank's greedy tokens."""
    model = build_tiny_model(tmp_path / "m", smol_hf_dir, "llama", hidden_size=48,
                             num_attention_heads=3, num_key_value_heads=3)
    prompts = [p for _, p in _prompts(num_docs=4, rounds=3)]
    options = dict(max_model_len=200, max_num_seqs=4, show_progress=False)
    want = _greedy(LLM(str(model), **options), prompts)
    # 24 blocks of one layer (K and V, 16 slots, 3 heads, rows of 16 float32): three
    # documents' worth, so four of them evict each other with two micro-batches in flight
    two = LLM(str(model), pipeline_parallel_size=2, kv_cache_memory=24 * 2 * 16 * 3 * 64,
              kv_offload_dir=str(tmp_path / "kv"), **options)
    engine = two.llm_engine
    try:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY)]
        stats = engine.get_stats().kv_offload
    finally:
        two.shutdown()
    assert engine.runner.num_blocks == 24
    assert got == want
    assert stats.writes > 0 and stats.hits > 0 and stats.drops == 0


def test_prompt_logprobs_under_a_split_equal_one_rank(tmp_path: Path, smol_hf_dir: Path
                                                      ) -> None:
    """Every rank computes the logits of the prompt rows too (the head's gather is a
    collective), the driver reads them; chunked prefill splits the prompt. Pipeline
    parallelism refuses them in one line."""
    model = build_tiny_model(tmp_path / "llama", smol_hf_dir, "llama", num_hidden_layers=4)
    options = dict(max_model_len=128, block_size=4, kv_cache_memory="4MiB",
                   max_num_batched_tokens=16, show_progress=False)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    prompts = [PROMPT_IDS[1], PROMPT_IDS[3]]

    def run(llm: LLM) -> list[list]:
        try:
            return [o.prompt_logprobs for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()

    expected = run(LLM(str(model), **options))
    got = run(LLM(str(model), **options, tensor_parallel_size=2))
    assert [len(e) for e in got] == [len(p) for p in prompts]
    for want, have in zip(expected, got):
        for a, b in zip(want[1:], have[1:]):
            assert a.keys() == b.keys()
            assert [lp.logprob for lp in a.values()] == pytest.approx(
                [lp.logprob for lp in b.values()], abs=1e-4)
    piped = LLM(str(model), **options, pipeline_parallel_size=2, pp_layer_partition="1,3")
    try:
        with pytest.raises(ValueError, match="prompt_logprobs is not served under pipeline"):
            piped.generate(prompts, params)
    finally:
        piped.shutdown()
