"""Qwen3 equals transformers token for token: per-head q/k norms with head_dim != hidden /
heads, GQA and MQA, and Qwen's per-layer sliding window shorter than the prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkv.core.model_loader.loader import open_model
from pkv.tests.helpers import build_tiny_model, check_matches_transformers, randomize_norms

CASES = {
    "gqa": dict(head_dim=32, num_key_value_heads=2),
    # layer 0 global, layer 1 windowed (max_window_layers=1); prompts run to 70 tokens
    "window": dict(head_dim=32, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "mqa": dict(head_dim=32, num_key_value_heads=1),
}


@pytest.mark.parametrize("name", CASES)
def test_qwen3_matches_transformers(tmp_path: Path, smol_hf_dir: Path, name: str) -> None:
    model_dir = build_tiny_model(tmp_path / name, smol_hf_dir, "qwen3", **CASES[name])
    randomize_norms(model_dir)
    if name == "window":
        assert open_model(str(model_dir)).config.layer_windows == (None, 8)
    check_matches_transformers(model_dir)
