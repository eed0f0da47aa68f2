"""SmolLM3 equals transformers token for token: NoPE layers (no RoPE where no_rope_layers
says 0), GQA, tied embeddings by default, and windows on the NoPE layers where the config
asks for them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pkv.core.model_loader.loader import open_model
from pkv.tests.helpers import build_tiny_model, check_matches_transformers

CASES = {
    # layers 0 and 2 without RoPE; tied (the field is then dropped: SmolLM3's default)
    "nope-gqa-tied": dict(num_hidden_layers=3, no_rope_layers=[0, 1, 0], head_dim=32,
                          tie_word_embeddings=True),
    # the default pattern (every 2nd layer without RoPE), those layers windowed
    "interval-window-mqa": dict(num_hidden_layers=4, no_rope_layer_interval=2,
                                num_key_value_heads=1, use_sliding_window=True,
                                sliding_window=12),
}


@pytest.mark.parametrize("name", CASES)
def test_smollm3_matches_transformers(tmp_path: Path, smol_hf_dir: Path, name: str) -> None:
    model_dir = build_tiny_model(tmp_path / name, smol_hf_dir, "smollm3", pad_token_id=0,
                                 **CASES[name])
    if name == "nope-gqa-tied":
        _drop_config_field(model_dir, "tie_word_embeddings")
        assert open_model(str(model_dir)).config.tie_word_embeddings
    else:  # pkv derives what transformers derives from the interval and use_sliding_window
        _drop_config_field(model_dir, "no_rope_layers")
        _drop_config_field(model_dir, "layer_types")
        assert open_model(str(model_dir)).config.layer_windows == (None, 12, None, 12)
    check_matches_transformers(model_dir)


def _drop_config_field(model_dir: Path, key: str) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.pop(key, None)
    path.write_text(json.dumps(config))
