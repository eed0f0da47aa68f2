"""Determinism under pressure: a KV pool far too small for 64 concurrent greedy decodes of
prompts sharing a prefix, with random aborts. Every request that finishes equals its solo
run; every block comes back."""

from __future__ import annotations

import random
from pathlib import Path

from pkv import LLM, SamplingParams
from pkv.core.config.engine import EngineConfig
from pkv.core.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(100, 40000) for _ in range(24)]  # one and a half blocks
    return [shared + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 20))]
            for _ in range(count)]


def test_outputs_survive_a_tiny_pool_and_random_aborts(tiny_llama_dir: Path) -> None:
    prompts = _prompts(64)
    solo = LLM(str(tiny_llama_dir), kv_cache_memory="4MiB", max_model_len=64,
               show_progress=False)
    expected = {f"r{i}": solo.generate([p], GREEDY)[0].outputs[0].token_ids
                for i, p in enumerate(prompts)}

    # 24 blocks of 16 tokens: room for about six of the 64 sequences at once.
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=24 * 8192,
                                    max_model_len=64, max_num_seqs=64,
                                    max_num_batched_tokens=96), show_progress=False)
    assert engine.runner.num_blocks == 24
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    rng = random.Random(11)
    aborted: set[str] = set()
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        if rng.random() < 0.3:
            victim = f"r{rng.randrange(64)}"
            if victim not in finished and victim not in aborted:
                engine.abort_request(victim)
                aborted.add(victim)
    stats = engine.get_stats()
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert 5 <= len(aborted) <= 40
    assert set(finished) | aborted == set(expected)
    for rid, tokens in finished.items():
        if rid not in aborted:
            assert tokens == expected[rid], rid
    assert stats.num_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
