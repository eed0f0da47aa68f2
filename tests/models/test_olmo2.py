"""OLMo 2 equals transformers token for token: norms after the sub-layers (none before) and
q/k RMSNorms over the whole projection, with random norm weights so a mix-up shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkv.tests.helpers import build_tiny_model, check_matches_transformers, randomize_norms

CASES = {
    "gqa": dict(head_dim=32, num_key_value_heads=2, rope_theta=500000.0),
    "mqa-tied": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "biased": dict(attention_bias=True),  # q, k, v and o projections
}


@pytest.mark.parametrize("name", CASES)
def test_olmo2_matches_transformers(tmp_path: Path, smol_hf_dir: Path, name: str) -> None:
    model_dir = build_tiny_model(tmp_path / name, smol_hf_dir, "olmo2", **CASES[name])
    randomize_norms(model_dir)
    check_matches_transformers(model_dir)
