"""Tensor parallelism beyond Llama: TP=2 (gloo ranks on CPU) decodes the same greedy tokens
as one rank on a tiny Qwen3-MoE (experts split by intermediate channels), Mixtral (the same,
windowed), a dense Qwen3 (per-head q/k norms on each rank's heads), Gemma 3 (two RoPE tables,
windows, soft-capped logits after the gather), Granite (multipliers), SmolLM3 (NoPE layers),
Mistral (a window) and OLMo 2 (q/k norms over every head: each rank's mean squares summed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkv import LLM, SamplingParams
from pkv.tests.helpers import build_tiny_model, randomize_norms

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], list(range(200, 260)), [7] * 9]
MODELS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[1], head_dim=32),
    "qwen3": dict(head_dim=32),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
    "gemma3": dict(head_dim=32, sliding_window=8, final_logit_softcapping=5.0),
    "granite": dict(embedding_multiplier=4.0, residual_multiplier=0.5,
                    attention_multiplier=0.2, logits_scaling=2.0),
    "smollm3": dict(no_rope_layers=[1, 0]),
    "mistral": dict(sliding_window=8),
    "olmo2": {},
}


def _greedy(model_dir: Path, tp: int) -> list[list[int]]:
    llm = LLM(str(model_dir), tensor_parallel_size=tp, kv_cache_memory="16MiB",
              max_model_len=256, show_progress=False)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", MODELS)
def test_tp2_equals_tp1(tmp_path: Path, smol_hf_dir: Path, arch: str) -> None:
    model_dir = build_tiny_model(tmp_path / arch, smol_hf_dir, arch, **MODELS[arch])
    randomize_norms(model_dir)  # (ones would hide a rank holding the wrong slice of a norm)
    assert _greedy(model_dir, 2) == _greedy(model_dir, 1)




def test_experts_narrower_than_the_split_are_a_clear_error() -> None:
    from pkv.core.distributed.parallel import check_tp_size
    from pkv.core.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 1})
    check_tp_size(cfg, 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 exceeds the experts' "
                                         r"intermediate size \(1\)"):
        check_tp_size(cfg, 2)
