"""Which families the C++ decoder stack computes (the README's "fast CPU path" column):
every dense family, with its windows, norms and multipliers; the MoE families and LongRoPE
take the Python layer loop and say why."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkv.core.config.engine import EngineConfig
from pkv.core.engine.llm_engine import LLMEngine
from pkv.core.worker.fused_decoder import fused_decoder_gaps
from pkv.tests.helpers import build_tiny_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
LONGROPE = dict(max_position_embeddings=512, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
    "short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [2.0 + i for i in range(8)]})

FAST = {
    "llama": {}, "mistral": dict(sliding_window=8), "qwen2": {}, "qwen3": {},
    "smollm3": {}, "granite": dict(residual_multiplier=0.5, embedding_multiplier=2.0),
    "olmo2": {}, "phi3": dict(partial_rotary_factor=0.5),
    "gemma2": dict(query_pre_attn_scalar=16, sliding_window=8), "gemma3": dict(sliding_window=8),
}
SLOW = {
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2), "MLP"),
    "qwen3_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "MLP"),
    "phi3": (LONGROPE, "LongRoPE"),
}


def _engine(tmp_path: Path, tokenizer_dir: Path, family: str, extra: dict) -> LLMEngine:
    model_dir = build_tiny_model(tmp_path / family, tokenizer_dir, family, **{**TINY, **extra})
    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="4MiB"),
                     show_progress=False)


@pytest.mark.parametrize("family", list(FAST))
def test_dense_families_run_on_the_cpp_decoder(tmp_path: Path, smol_hf_dir: Path, family: str):
    engine = _engine(tmp_path, smol_hf_dir, family, FAST[family])
    assert fused_decoder_gaps(engine.runner.model) == []
    assert engine.runner.model.model.fused is not None
    engine.shutdown()


@pytest.mark.parametrize("family", list(SLOW))
def test_others_take_the_python_loop_and_say_why(tmp_path: Path, smol_hf_dir: Path,
                                                 family: str):
    extra, reason = SLOW[family]
    engine = _engine(tmp_path, smol_hf_dir, family, extra)
    assert engine.runner.model.model.fused is None
    assert any(reason in gap for gap in fused_decoder_gaps(engine.runner.model))
    engine.shutdown()
