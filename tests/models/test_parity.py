"""Greedy output equals transformers' greedy output, token for token, under batching, block
sizes, chunked prefill, preemption and prefix caching."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkv import LLM, SamplingParams
from pkv.tests.helpers import build_tiny_model, hf_greedy

NEW_TOKENS = 24
EOS = 2


def _pkv_greedy(llm: LLM, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n))
    assert [o.prompt_token_ids for o in outs] == prompts
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def smol_reference(smol_hf_model, smol_prompt_ids: list[list[int]]) -> list[list[int]]:
    return hf_greedy(smol_hf_model, smol_prompt_ids, NEW_TOKENS, EOS)


def test_bundled_gguf_matches_transformers(smol_gguf: Path, smol_prompt_ids, smol_reference):
    llm = LLM(str(smol_gguf), kv_cache_memory="64MiB", max_model_len=256, show_progress=False)
    assert _pkv_greedy(llm, smol_prompt_ids) == smol_reference
    assert any(len(r) == NEW_TOKENS for r in smol_reference)  # the run really decoded


@pytest.mark.parametrize("options", [
    dict(block_size=1),
    dict(block_size=32),
    dict(max_num_batched_tokens=7),  # prefills in chunks over many steps, decodes in between
    dict(enable_prefix_caching=False),
    dict(attention_backend="torch"),
    dict(attention_backend="cpu", block_size=32, max_num_batched_tokens=16),
], ids=["block1", "block32", "chunked", "no-prefix-cache", "backend-torch", "backend-cpu"])
def test_engine_variants_match_transformers(smol_hf_dir: Path, smol_prompt_ids, smol_reference,
                                            options: dict):
    llm = LLM(str(smol_hf_dir), kv_cache_memory="64MiB", max_model_len=256,
              show_progress=False, **options)
    assert _pkv_greedy(llm, smol_prompt_ids) == smol_reference
    stats = llm.llm_engine.get_stats()
    assert stats.num_blocks_used == 0


def test_preemption_keeps_output(smol_hf_dir: Path, smol_prompt_ids, smol_reference):
    # 12 blocks of 16 tokens cannot hold 8 sequences of up to ~60 + 24 tokens at once.
    per_block = 2 * 30 * 16 * 3 * 64 * 4
    llm = LLM(str(smol_hf_dir), kv_cache_memory=12 * per_block, max_model_len=96,
              show_progress=False)
    assert _pkv_greedy(llm, smol_prompt_ids) == smol_reference
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.num_blocks_used == 0


def test_prefix_cache_hits_keep_output(smol_hf_dir: Path, smol_prompt_ids, smol_reference):
    llm = LLM(str(smol_hf_dir), kv_cache_memory="64MiB", max_model_len=256, show_progress=False)
    first = _pkv_greedy(llm, smol_prompt_ids)
    again = llm.generate(smol_prompt_ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert first == smol_reference
    assert [o.outputs[0].token_ids for o in again] == smol_reference
    assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("qwen2", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}}),
    ("mistral", {"tie_word_embeddings": True}),
    ("llama", {"attention_bias": True}),  # biases q, k, v and o_proj
], ids=["llama", "qwen2", "llama3-rope", "mistral-tied", "llama-biased"])
def test_tiny_models_match_transformers(tmp_path: Path, smol_hf_dir: Path, arch: str,
                                        overrides: dict):
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / arch, smol_hf_dir, arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [[(7 * i + 13 * j) % 49000 + 100 for j in range(3 + 9 * i)] for i in range(8)]
    reference = hf_greedy(hf, prompts, NEW_TOKENS, EOS)
    for options in ({}, {"block_size": 1, "max_num_batched_tokens": 5},
                    {"attention_backend": "torch"}):
        llm = LLM(str(model_dir), kv_cache_memory="8MiB", show_progress=False, **options)
        assert _pkv_greedy(llm, prompts) == reference, options


def test_triton_backend_matches_transformers(tiny_llama_dir: Path):
    """The Triton kernel (interpreted on CPU) end to end, token for token."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    prompts = [[100 + 3 * j for j in range(n)] for n in (3, 20, 37)]
    llm = LLM(str(tiny_llama_dir), kv_cache_memory="8MiB", attention_backend="triton",
              show_progress=False)
    assert llm.llm_engine.attention_backend == "triton"
    assert _pkv_greedy(llm, prompts, 6) == hf_greedy(hf, prompts, 6, EOS)
