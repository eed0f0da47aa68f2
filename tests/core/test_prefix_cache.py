"""Prefix caching and chunked prefill through the engine on tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkv import LLM, SamplingParams
from pkv.core.sched import request as request_module
from pkv.tests.helpers import build_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture()
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), kv_cache_memory="8MiB", show_progress=False)


def test_hits_are_exactly_the_shared_full_blocks(llm: LLM):
    engine = llm.llm_engine
    base = list(range(200, 240))  # 40 tokens
    llm.generate([base], GREEDY)
    queries, hits = engine.kv_cache.prefix_queries, engine.kv_cache.prefix_hits
    other = base[:35] + [7, 8, 9, 10, 11]  # shares 35 tokens: two full blocks of 16
    out = llm.generate([other], GREEDY)[0]
    assert out.num_cached_tokens == 32
    assert engine.kv_cache.prefix_hits - hits == 32
    assert engine.kv_cache.prefix_queries - queries == len(other)


def test_same_prompt_reuses_all_but_the_last_token(llm: LLM):
    prompt = list(range(300, 332))  # exactly two blocks: the second holds the last token
    first, again = (llm.generate([prompt], GREEDY)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_cache_salt_separates_tenants(llm: LLM):
    engine = llm.llm_engine
    prompt = list(range(400, 450))

    def run(salt: str) -> tuple[int, list[int]]:
        engine.add_request(f"salt-{salt}-{engine.num_steps}", prompt, GREEDY, cache_salt=salt)
        (out,) = engine.generate_until_done()
        return out.num_cached_tokens, out.outputs[0].token_ids

    cached_a, tokens_a = run("tenant-a")
    cached_b, tokens_b = run("tenant-b")
    cached_a2, _ = run("tenant-a")
    assert cached_a == 0 and cached_b == 0 and cached_a2 == 48
    assert tokens_a == tokens_b


def test_identical_concurrent_prompts_share_blocks(llm: LLM):
    engine = llm.llm_engine
    prompt = list(range(500, 540))
    for i in range(3):
        engine.add_request(f"same{i}", prompt, GREEDY)
    engine.step()
    tables = [engine.kv_cache.block_ids(f"same{i}")[0] for i in range(3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[-1] for t in tables}) == 3  # each has its own partial last block
    outs = engine.generate_until_done()
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1


def test_forced_hash_collision_still_gives_correct_output(tiny_llama_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch):
    prompts = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(4)]
    reference = _tokens(LLM(str(tiny_llama_dir), kv_cache_memory="8MiB", show_progress=False,
                            enable_prefix_caching=False).generate(prompts, GREEDY))
    # Every block now hashes the same: the lookup table collides on every query.
    monkeypatch.setattr(request_module, "hash_block", lambda parent, tokens, extra=b"": b"same")
    llm = LLM(str(tiny_llama_dir), kv_cache_memory="8MiB", show_progress=False)
    outs = llm.generate(prompts, GREEDY)
    assert _tokens(outs) == reference
    assert all(o.num_cached_tokens == 0 for o in outs)  # no false hit was taken


def test_every_block_is_reclaimable_after_load(llm: LLM):
    engine = llm.llm_engine
    prompts = [list(range(600 + i, 650 + i)) for i in range(12)]
    llm.generate(prompts, SamplingParams(temperature=0.8, seed=1, max_tokens=20))
    pool = engine.kv_cache.pool
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.num_blocks
    assert pool.num_cached_blocks > 0  # freed blocks stay findable until needed
    taken = pool.allocate(pool.num_blocks)  # ... and the pool can still hand out every one
    assert len({b.block_id for b in taken}) == pool.num_blocks and pool.num_cached_blocks == 0
    pool.free(taken)


def test_decode_keeps_advancing_while_a_long_prompt_prefills(tmp_path: Path, smol_hf_dir: Path):
    model = build_tiny_model(tmp_path / "long", smol_hf_dir, max_position_embeddings=4096)
    llm = LLM(str(model), kv_cache_memory="32MiB", max_num_batched_tokens=256,
              show_progress=False)
    engine = llm.llm_engine
    engine.add_request("stream", [5, 6, 7], SamplingParams(temperature=0, max_tokens=40,
                                                           ignore_eos=True))
    engine.step()
    long_prompt = [(13 * i) % 40000 + 100 for i in range(2000)]
    engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=2))
    stream = engine.scheduler.requests["stream"]
    long_req = engine.scheduler.requests["long"]
    steps = 0
    while long_req.num_computed_tokens < len(long_prompt):
        before = stream.num_output_tokens
        engine.step()
        steps += 1
        assert stream.num_output_tokens == before + 1  # one token every step, no stall
    assert steps >= 2000 // 256
    chunked = {o.request_id: o.outputs[0].token_ids for o in engine.generate_until_done()}
    whole = LLM(str(model), kv_cache_memory="32MiB", max_num_batched_tokens=4096,
                show_progress=False).generate([long_prompt], SamplingParams(
                    temperature=0, max_tokens=2))
    assert chunked["long"] == whole[0].outputs[0].token_ids
