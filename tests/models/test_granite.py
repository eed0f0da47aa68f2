"""Granite equals transformers token for token, with every multiplier far from 1 so that a
missing or misplaced one changes the tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pkv import LLM, SamplingParams
from pkv.tests.helpers import build_tiny_model, check_matches_transformers, parity_prompts

# initializer_range 0.2: with 0.08 the attention of a tiny random model is near uniform
# whatever its scale, and a wrong attention_multiplier would go unseen
MULTIPLIERS = dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                   attention_multiplier=0.0625, logits_scaling=8.0, initializer_range=0.2)


@pytest.mark.parametrize("overrides", [
    dict(head_dim=32),  # 0.0625 is not head_dim ** -0.5 (0.177)
    dict(num_key_value_heads=1, tie_word_embeddings=True),
], ids=["gqa", "mqa-tied"])
def test_granite_matches_transformers(tmp_path: Path, smol_hf_dir: Path, overrides: dict):
    model_dir = build_tiny_model(tmp_path / "granite", smol_hf_dir, "granite",
                                 **MULTIPLIERS, **overrides)
    check_matches_transformers(model_dir)


def test_granite_logits_are_scaled(tmp_path: Path, smol_hf_dir: Path):
    """Dividing the logits by logits_scaling leaves greedy tokens alone; the log-probs show it."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / "granite", smol_hf_dir, "granite", **MULTIPLIERS)
    prompt = parity_prompts(count=1)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], dim=-1)
    llm = LLM(str(model_dir), show_progress=False, kv_cache_memory="16MiB")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=0))
    token = out[0].outputs[0].token_ids[0]
    got = out[0].outputs[0].logprobs[0][token].logprob
    assert token == int(expected.argmax())
    assert abs(got - float(expected[token])) < 1e-4, (got, float(expected[token]))
    llm.llm_engine.shutdown()
