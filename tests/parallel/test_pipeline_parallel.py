"""Pipeline parallelism over gloo on CPU: two stages (and two stages of two tensor-parallel
ranks) give the same greedy tokens as one rank (batched, chunked prefill, preemption,
prefix-cache hits, hybrid-window models), each stage holds its share of the weights, and
partitions are checked (a dead stage: tests/parallel/test_tensor_parallel.py; adapters and
speculative decoding under either split: tests/parallel/test_tp_features.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from pkv import LLM, SamplingParams, StructuredOutputsParams
from pkv.core.distributed.pipeline import partition_layers
from pkv.tests.conftest import PROMPTS
from pkv.cli.bench.embed import write_random_bert
from pkv.tests.helpers import build_tiny_model, kv_block_bytes, save_headless_qwen3
from pkv.tests.models.test_gemma import GEMMA3
from pkv.tests.parallel.test_tensor_parallel import _gone

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPT_IDS = [[1, 2, 3, 4], list(range(200, 260)), [7] * 9, list(range(300, 341))]


def _greedy(llm: LLM, prompts: list) -> list[list[int]]:  # noqa: ANN001
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_pp2_equals_pp1_on_the_bundled_model(smol_llm: LLM) -> None:
    pp = LLM(pipeline_parallel_size=2, kv_cache_memory="128MiB", max_model_len=512,
             show_progress=False)
    try:
        assert _greedy(pp, PROMPTS) == _greedy(smol_llm, PROMPTS)
        # prefix-cache hits on the second pass, in both stages' KV alike
        again = pp.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in again] == _greedy(smol_llm, PROMPTS)
        assert any(o.num_cached_tokens for o in again)
        # guided decoding lives in the driver: the same constrained answers
        guided = SamplingParams(max_tokens=12, temperature=0, structured_outputs=(
            StructuredOutputsParams(regex=r"(yes|no), [a-z]{2,8}\.")))
        assert ([o.outputs[0].text for o in pp.generate(PROMPTS[:3], guided)]
                == [o.outputs[0].text for o in smol_llm.generate(PROMPTS[:3], guided)])
        runner = pp.llm_engine.runner
        whole = smol_llm.llm_engine.runner.weight_bytes
        assert len(runner.rank_weight_bytes) == 2
        assert all(b <= 0.55 * whole for b in runner.rank_weight_bytes), (
            runner.rank_weight_bytes, whole)
        assert runner.stage.layers(30) == range(0, runner.stage.end or 30)
        pids = pp.llm_engine.workers.pids
    finally:
        pp.shutdown()
    assert _gone(pids, 5)


def test_tp2_x_pp2_equals_one_rank_on_the_bundled_model(smol_llm: LLM) -> None:
    """Four ranks: two stages of two tensor-parallel ranks each (a process group per
    stage); each stage's ranks share its layers' heads and the driver's stage the LM head."""
    llm = LLM(pipeline_parallel_size=2, tensor_parallel_size=2, kv_cache_memory="128MiB",
              max_model_len=512, show_progress=False)
    try:
        assert _greedy(llm, PROMPTS) == _greedy(smol_llm, PROMPTS)
        per_rank = llm.llm_engine.runner.rank_weight_bytes
        whole = smol_llm.llm_engine.runner.weight_bytes
        assert len(per_rank) == 4 and max(per_rank) <= 0.3 * whole, (per_rank, whole)
        pids = llm.llm_engine.workers.pids
    finally:
        llm.shutdown()
    assert _gone(pids, 10)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_pp2_equals_pp1_on_tiny_models_chunked_and_preempted(family: str, tmp_path: Path,
                                                            smol_hf_dir: Path) -> None:
    """Four layers split 1 + 3 (pp_layer_partition); a 4-token prefill chunk and a pool too
    small for every sequence at once (preemption recomputes across both stages)."""
    model = build_tiny_model(tmp_path / family, smol_hf_dir, family, num_hidden_layers=4)
    options = dict(max_model_len=128, block_size=4, max_num_batched_tokens=16,
                   show_progress=False)
    expected = _greedy(LLM(str(model), kv_cache_memory="1MiB", **options), PROMPT_IDS)
    # 40 blocks of the second stage's 3 layers: one sequence of max_model_len (32 blocks),
    # not all four at once.
    per_layer = kv_block_bytes(model, 4)[0] // 4
    pp = LLM(str(model), pipeline_parallel_size=2, pp_layer_partition="1,3",
             kv_cache_memory=40 * 3 * per_layer, **options)
    try:
        assert pp.llm_engine.runner.stage.end == 1
        assert _greedy(pp, PROMPT_IDS) == expected
        assert pp.llm_engine.scheduler.num_preemptions > 0
    finally:
        pp.shutdown()


@pytest.mark.parametrize("partition", ["1,3", "2,2"])
def test_hybrid_window_models_under_pp_equal_one_rank(partition: str, tmp_path: Path,
                                                      smol_hf_dir: Path) -> None:
    """A Gemma-3-shaped model (windowed, global, windowed, global; window 8, shorter than
    the prompts): the driver keeps the whole model's KV groups; a stage's blocks hold its
    own layers of them (1 + 3: the first stage has no global layer)."""
    model = build_tiny_model(tmp_path / "gemma3", smol_hf_dir, "gemma3",
                             **{**GEMMA3, "num_hidden_layers": 4})
    options = dict(max_model_len=128, block_size=4, max_num_batched_tokens=16,
                   kv_cache_memory="2MiB", show_progress=False)
    one = LLM(str(model), **options)
    expected = _greedy(one, PROMPT_IDS)
    assert len(one.llm_engine.runner.kv_groups.groups) == 2
    pp = LLM(str(model), pipeline_parallel_size=2, pp_layer_partition=partition, **options)
    try:
        runner = pp.llm_engine.runner
        assert runner.kv_groups.windows == [None, 8]
        assert runner.kv_groups.slots == 1  # the driver holds one layer of each group at most
        assert _greedy(pp, PROMPT_IDS) == expected
        assert pp.llm_engine.get_stats().num_blocks_used == 0
    finally:
        pp.shutdown()


@pytest.mark.parametrize(("split", "name"), [
    (dict(pipeline_parallel_size=2, pp_layer_partition="1,3"), "pipeline parallelism"),
    (dict(tensor_parallel_size=2), "tensor parallelism"),
    # (the last stage's second member sent its rows to nobody: the step after hung)
    (dict(tensor_parallel_size=2, pipeline_parallel_size=2), "tensor parallelism")])
def test_a_decoder_embedding_model_under_a_split_equals_one_rank(split: dict, name: str,
                                                                 tmp_path: Path,
                                                                 smol_hf_dir: Path) -> None:
    """A headless Qwen3 (an embedding checkpoint) in two stages (the last stage sends the
    pooling prompts' rows back to the driver) or over two ranks: the driver's pooler makes
    the same vectors. An encoder is not split, in one line."""
    model = save_headless_qwen3(tmp_path / "qwen3-embed", smol_hf_dir, num_hidden_layers=4)
    prompts = [PROMPT_IDS[i % 4] + [i] for i in range(6)]
    one = LLM(str(model), kv_cache_memory="16MiB", show_progress=False)
    expected = [o.outputs.data for o in one.embed(prompts)]
    two = LLM(str(model), kv_cache_memory="16MiB", show_progress=False, **split)
    try:
        got = [o.outputs.data for o in two.embed(prompts)]
        assert all(torch.allclose(g, e, atol=1e-5) for g, e in zip(got, expected))
        assert two.llm_engine.get_stats().num_blocks_used == 0
    finally:
        two.shutdown()
    with pytest.raises(ValueError, match=f"does not run with {name}"):
        LLM(str(write_random_bert(tmp_path / "bert")), show_progress=False, **split)


def test_partitions_balance_bytes_and_bad_ones_are_one_line_errors(tiny_llama_dir: Path
                                                                   ) -> None:
    assert partition_layers(30, 2) == [15, 15]
    # the first stage also holds the embedding and head: it takes fewer layers
    assert partition_layers(30, 3, layer_bytes=1, first_extra=9) == [4, 13, 13]
    for bad, match in [("1,1,1", "must give 2 stages"), ("2,x", "comma-separated integers"),
                       ("0,2", "must give 2 stages")]:
        with pytest.raises(ValueError, match=match):
            LLM(str(tiny_llama_dir), pipeline_parallel_size=2, pp_layer_partition=bad,
                show_progress=False)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        LLM(str(tiny_llama_dir), pipeline_parallel_size=3, show_progress=False)
    with pytest.raises(ValueError, match="pp_layer_partition needs pipeline_parallel_size"):
        LLM(str(tiny_llama_dir), pp_layer_partition="1,1", show_progress=False)


def test_requests_aborted_in_flight_leave_nothing_behind(tiny_llama_dir: Path) -> None:
    """Aborting requests whose micro-batch is still in the pipeline: the engine serves on
    with the same answers, and shutdown takes their rows back instead of waiting on them."""
    llm = LLM(str(tiny_llama_dir), pipeline_parallel_size=2, kv_cache_memory="16MiB",
              max_model_len=128, show_progress=False)
    engine = llm.llm_engine
    try:
        expected = _greedy(llm, PROMPT_IDS[:2])
        for i in range(4):
            engine.add_request(f"gone{i}", [1, 2, 3, 4 + i], GREEDY)
        while not engine.micro_batches:
            engine.step()
        engine.abort_request([f"gone{i}" for i in range(4)])
        assert _greedy(llm, PROMPT_IDS[:2]) == expected
        for i in range(4):
            engine.add_request(f"again{i}", [1, 2, 3, 4 + i], GREEDY)
        while not engine.micro_batches:
            engine.step()
        engine.abort_request([f"again{i}" for i in range(4)])
        assert engine.get_stats().num_blocks_used == 0
        pids = engine.workers.pids
        start = time.monotonic()
    finally:
        llm.shutdown()
    assert time.monotonic() - start < 5  # (without taking the rows back: a 10 s kill)
    assert _gone(pids, 5)
