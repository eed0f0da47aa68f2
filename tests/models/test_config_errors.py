"""Bad model configs: one line naming the problem, raised by ModelConfig.from_hf_dict before
any weights load, and `pkv serve` on such a folder exits with that line, no traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pkv.cli.main import app
from pkv.core.models.config import ModelConfig
from pkv.core.models.registry import ARCHITECTURES


def _llama(**changes: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=512)
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


CASES = {
    "unsupported-architecture": (_llama(architectures=["MambaForCausalLM"]),
                                 "unsupported architecture"),
    "missing-field": (_llama(hidden_size=None), "'hidden_size'"),
    "missing-family-field": (_llama(intermediate_size=None), "'intermediate_size'"),
    "unknown-rope-scaling": (_llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                             "rope_scaling"),
    "mistral-window-0": (_llama(architectures=["MistralForCausalLM"], sliding_window=0),
                         "sliding_window"),
    "phi3-window-0": (_llama(architectures=["Phi3ForCausalLM"], sliding_window=0),
                      "sliding_window"),
    "mlp-bias": (_llama(mlp_bias=True), "mlp_bias"),
    "attn-soft-cap": (_llama(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    "granite-multiplier-on-llama": (_llama(residual_multiplier=0.22), "residual_multiplier"),
    "partial-rotary-on-llama": (_llama(partial_rotary_factor=0.5), "partial_rotary_factor"),
    "smollm3-no-rope-layers": (_llama(architectures=["SmolLM3ForCausalLM"],
                                      no_rope_layers=[1, 0, 1]), "no_rope_layers"),
    "phi3-longrope-factors": (_llama(architectures=["Phi3ForCausalLM"], rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 3}),
        "rope_scaling.long_factor"),
    # values of the wrong kind: named here, not a crash in a layer once weights load
    "layers-as-text": (_llama(num_hidden_layers="2"), "num_hidden_layers='2'"),
    "hidden-as-float": (_llama(hidden_size=64.0), "hidden_size=64.0"),
    "negative-vocab": (_llama(vocab_size=-5), "vocab_size=-5"),
    "eps-as-text": (_llama(rms_norm_eps="1e-5"), "rms_norm_eps='1e-5'"),
    "positions-as-text": (_llama(max_position_embeddings="512"), "max_position_embeddings"),
    "rope-scaling-list": (_llama(rope_scaling=[1, 2]), "rope_scaling must be a mapping"),
    "linear-rope-no-factor": (_llama(rope_scaling={"rope_type": "linear"}), "lacks 'factor'"),
    "rope-factor-as-text": (_llama(rope_scaling={"rope_type": "linear", "factor": "2"}),
                            "rope_scaling.factor='2'"),
    "quantization-config-text": (_llama(quantization_config="awq"), "quantization_config"),
    "eos-as-text": (_llama(eos_token_id="2"), "eos_token_id='2'"),
    "tie-as-text": (_llama(tie_word_embeddings="false"), "tie_word_embeddings='false'"),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_config_is_one_line_naming_the_field(name: str) -> None:
    cfg, needle = CASES[name]
    with pytest.raises(ValueError) as info:
        ModelConfig.from_hf_dict(cfg)
    message = str(info.value)
    assert needle in message and "\n" not in message, message


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError) as info:
        ModelConfig.from_hf_dict(_llama(architectures=["MambaForCausalLM"]))
    assert all(arch in str(info.value) for arch in ARCHITECTURES)


def test_serve_on_a_bad_config_is_one_line(tmp_path: Path) -> None:
    # config.json only: the error must come before tokenizer or weights are looked for
    (tmp_path / "config.json").write_text(json.dumps(_llama(mlp_bias=True)))
    result = CliRunner().invoke(app, ["serve", str(tmp_path), "--port", "0"])
    assert result.exit_code not in (0, None)
    assert "mlp_bias" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
