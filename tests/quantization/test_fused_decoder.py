"""The C++ decoder stack on CPU (core/worker/fused_decoder.py), over AWQ linears (Qwen2, with qkv
biases) and oneDNN-packed float32 ones (Llama): the same hidden states, bit for bit, and the
same tokens as the Python model running the same kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pkv.core.config.engine import EngineConfig
from pkv.core.engine.llm_engine import LLMEngine
from pkv.core.sample.sampling_params import SamplingParams
from pkv.csrc import cpp_build
from pkv.quantize.pipeline import QuantizeReport


def _engine(model: Path, **extra: object) -> LLMEngine:
    config = EngineConfig(model=str(model), max_model_len=256, kv_cache_memory="8MiB",
                          **extra)
    return LLMEngine(config, show_progress=False)


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(None, prompt, params) for prompt in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


# AWQ with integer activations where the kernels have them (not on the generic flavour).
_INTEGER = ["awq-int16", "awq-int8"] if cpp_build.selected_flavour() != "generic" else []


@pytest.fixture(scope="module", params=["awq", *_INTEGER, "float32"])
def engine(request: pytest.FixtureRequest, awq_tiny: tuple[Path, QuantizeReport],
               tiny_llama_dir: Path) -> LLMEngine:
    if request.param == "float32":
        engine = _engine(tiny_llama_dir)
    else:  # integer activations: the decoder must pass the setting on to its AWQ GEMVs
        activations = {"awq": "float32", "awq-int16": "int16", "awq-int8": "int8"}[request.param]
        engine = _engine(awq_tiny[0], awq_activations=activations)
    if engine.runner.model.model.fused is None:
        pytest.fail(f"a {request.param} model on CPU with every kernel built should run the "
                    "fused decoder")
    return engine


def test_fused_tokens_equal_the_python_model(engine: LLMEngine):
    # Ragged prompts in one batch: prefills of several lengths, then batched decodes.
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    fused_model = engine.runner.model.model
    fused = fused_model.fused
    # Both runs compute the whole prompts: a cached prefix would change the steps' row counts,
    # and with integer activations the GEMV (up to awq_gemv_max_rows rows) and the float GEMM round
    # differently.
    engine.kv_cache.pool.reset_prefix_cache()
    with_fused = _greedy(engine, prompts)
    fused_model.fused = None
    engine.kv_cache.pool.reset_prefix_cache()
    try:
        without = _greedy(engine, prompts)
    finally:
        fused_model.fused = fused
    assert with_fused == without
    assert engine.kv_cache.pool.num_used_blocks == 0  # nothing leaked


def test_fused_hidden_states_are_bitwise_those_of_the_python_path(engine: LLMEngine):
    runner = engine.runner
    inner = runner.model.model
    cfg = runner.model_config
    gemm_rows = cpp_build.kernels().awq_gemv_max_rows + 1
    for tokens in (torch.arange(3, 9), torch.arange(3, 3 + gemm_rows)):  # GEMV, GEMM rows
        # Copies of the pool, so the engine's cached blocks stay as they were.
        fused_caches, python_caches = ([(k.clone(), v.clone()) for k, v in runner.kv_caches]
                                       for _ in range(2))
        meta = _one_sequence_meta(len(tokens), runner.block_size)
        with torch.inference_mode():
            fused_hidden = inner(tokens, torch.arange(len(tokens)), fused_caches, meta)
            fused, inner.fused = inner.fused, None
            try:
                python_hidden = inner(tokens, torch.arange(len(tokens)), python_caches, meta)
            finally:
                inner.fused = fused
        assert fused_hidden.shape == (len(tokens), cfg.hidden_size)
        assert torch.equal(fused_hidden, python_hidden)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                   for a, b in zip(fused_caches, python_caches))  # the same K/V written


def test_fused_hidden_states_outlive_the_next_step(engine: LLMEngine):
    # The decoder reuses its buffers across the layers of one step, never across steps: a
    # step's hidden states stay as they were returned while the next step runs.
    runner = engine.runner
    inner = runner.model.model
    caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    meta = _one_sequence_meta(1, runner.block_size)
    with torch.inference_mode():
        first = inner(torch.tensor([7]), torch.arange(1), caches, meta)
        kept = first.clone()
        second = inner(torch.tensor([11]), torch.arange(1), caches, meta)
    assert torch.equal(first, kept)
    assert not torch.equal(first, second)


def test_a_team_of_two_threads_computes_what_one_thread_does(engine: LLMEngine, two_threads):
    # At decode sizes the forward runs in one team of threads; its loops split the work as
    # at::parallel_for does, so two threads give one thread's values bit for bit.
    runner = engine.runner
    inner = runner.model.model
    for n in (1, 5):
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
            with torch.inference_mode():
                hidden = inner(torch.arange(3, 3 + n), torch.arange(n), caches,
                               _one_sequence_meta(n, runner.block_size))
            results.append((hidden, caches))
        (one, one_caches), (two, two_caches) = results
        assert torch.equal(one, two)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                   for a, b in zip(one_caches, two_caches))


def test_a_check_failing_inside_the_team_raises_and_the_next_call_runs(engine: LLMEngine,
                                                                        two_threads):
    runner = engine.runner
    inner = runner.model.model
    caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    meta = _one_sequence_meta(1, runner.block_size)
    meta.slot_mapping = torch.tensor([10**9])  # past the pool: write_kv's check fails
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="slot out of range"):
            inner(torch.tensor([7]), torch.arange(1), caches, meta)
        hidden = inner(torch.tensor([7]), torch.arange(1), caches,
                       _one_sequence_meta(1, runner.block_size))
    assert hidden.shape == (1, runner.model_config.hidden_size)
    assert bool(torch.isfinite(hidden).all())


def _one_sequence_meta(n: int, block_size: int):  # noqa: ANN202 - AttentionMetadata
    from pkv.core.layers.attention_backend import AttentionMetadata

    blocks = -(-n // block_size)
    positions = torch.arange(n)
    return AttentionMetadata(
        slot_mapping=positions.clone(), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None], num_decode_tokens=0,
        seq_ids=torch.zeros(n, dtype=torch.int32),
        kv_lens=(positions + 1).to(torch.int32), query_start_loc_cpu=[0, n], seq_lens_cpu=[n])


def test_float_models_and_other_backends_keep_the_python_path(tiny_llama_dir: Path,
                                                              awq_tiny: tuple[Path,
                                                                              QuantizeReport]):
    assert _engine(tiny_llama_dir, dtype="bfloat16").runner.model.model.fused is None
    torch_attention = _engine(awq_tiny[0], attention_backend="torch")
    assert torch_attention.runner.model.model.fused is None
