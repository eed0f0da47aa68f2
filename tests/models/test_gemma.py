"""Gemma 2 and Gemma 3 (text) decode as transformers does: scaled embeddings, (1 + weight)
norms before and after each sub-layer, `query_pre_attn_scalar`, attention and final logit
soft-capping, interleaved sliding / global layers, Gemma 3's q/k norms and RoPE per layer
type. Tiny random models whose shapes and constants make each of these matter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pkv import LLM, SamplingParams
from pkv.core.layers.norm import GemmaRMSNorm
from pkv.core.models.config import ModelConfig
from pkv.tests.helpers import build_tiny_model, check_matches_transformers, hf_greedy

# head_dim 32 != 64 / 4 heads, GQA, a window of 8 shorter than every prompt (9-70 tokens)
COMMON: dict[str, Any] = dict(head_dim=32, sliding_window=8, tie_word_embeddings=True,
                              num_hidden_layers=3)
GEMMA2: dict[str, Any] = dict(COMMON, query_pre_attn_scalar=24, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0,
                              layer_types=["sliding_attention", "full_attention",
                                           "sliding_attention"])
GEMMA3: dict[str, Any] = dict(COMMON, query_pre_attn_scalar=24, sliding_window_pattern=2,
                              rope_parameters={
                                  "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                     "rope_theta": 1_000_000.0},
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 100.0}})
PROMPTS = [[100 + 7 * j for j in range(40)], [300 + 11 * j for j in range(25)]]


def _gemma_dir(tmp: Path, tokenizer: Path, family: str, **overrides: Any) -> Path:
    fields = {**(GEMMA2 if family == "gemma2" else GEMMA3), **overrides}
    return build_tiny_model(tmp, tokenizer, family, **fields)


def test_gemma2_matches_transformers(tmp_path: Path, smol_hf_dir: Path):
    check_matches_transformers(_gemma_dir(tmp_path, smol_hf_dir, "gemma2"))


@pytest.fixture(scope="module")
def gemma2_capped_dir(tmp_path_factory: pytest.TempPathFactory, smol_hf_dir: Path) -> Path:
    # Caps small enough to clip the scores and logits of tiny random weights.
    return _gemma_dir(tmp_path_factory.mktemp("gemma2-capped"), smol_hf_dir, "gemma2",
                      attn_logit_softcapping=0.5, final_logit_softcapping=5.0)


def test_gemma2_small_caps_matter_and_match(gemma2_capped_dir: Path):
    check_matches_transformers(gemma2_capped_dir)
    # transformers' own tokens change without the attention cap: it is not inert here
    from transformers import AutoModelForCausalLM

    prompts = PROMPTS[:2]
    uncapped = AutoModelForCausalLM.from_pretrained(
        gemma2_capped_dir, attn_implementation="eager", attn_logit_softcapping=None).eval()
    capped = AutoModelForCausalLM.from_pretrained(gemma2_capped_dir,
                                                  attn_implementation="eager").eval()
    assert hf_greedy(uncapped, prompts, 12, None) != hf_greedy(capped, prompts, 12, None)
    _assert_logprobs_match(gemma2_capped_dir)


def _assert_logprobs_match(model_dir: Path) -> None:
    """pkv's log-probabilities of its greedy tokens equal transformers' (the final cap is
    monotonic, so only these show it), and differ from them without the final cap."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(model_dir), block_size=4, kv_cache_memory="16MiB", show_progress=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, logprobs=0))
    tokens = [o.outputs[0].token_ids for o in outs]
    ours = torch.tensor([[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                           o.outputs[0].logprobs)]
                         for o in outs])

    def reference(**fields: Any) -> torch.Tensor:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                  **fields).eval()
        rows = []
        for prompt, new in zip(PROMPTS, tokens):
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + new])).logits[0, len(prompt) - 1:-1]
            rows.append(logits.log_softmax(-1).gather(-1, torch.tensor(new)[:, None])[:, 0])
        return torch.stack(rows)

    torch.testing.assert_close(ours, reference(), rtol=0, atol=1e-4)
    assert (ours - reference(final_logit_softcapping=None)).abs().max() > 1e-2


def test_gemma2_cpu_backend_window_and_caps(gemma2_capped_dir: Path):
    # The C++ kernel implements the window and the soft-cap itself.
    from transformers import AutoModelForCausalLM

    prompts = [[100 + 7 * j for j in range(n)] for n in (9, 30, 70)]
    hf = AutoModelForCausalLM.from_pretrained(gemma2_capped_dir,
                                              attn_implementation="eager").eval()
    reference = hf_greedy(hf, prompts, 16, 2)
    llm = LLM(str(gemma2_capped_dir), attention_backend="cpu", block_size=4,
              max_num_batched_tokens=16, kv_cache_memory="16MiB", show_progress=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_gemma3_matches_transformers(tmp_path: Path, smol_hf_dir: Path):
    check_matches_transformers(_gemma_dir(tmp_path, smol_hf_dir, "gemma3"))


def test_gemma3_mqa_final_cap_and_ignored_attention_cap(tmp_path: Path, smol_hf_dir: Path):
    # One KV head, explicit layer_types, an untied head, a small final cap; transformers'
    # Gemma 3 never applies attn_logit_softcapping, so a tiny one must change nothing.
    model_dir = _gemma_dir(tmp_path, smol_hf_dir, "gemma3", num_key_value_heads=1,
                           tie_word_embeddings=False, final_logit_softcapping=5.0,
                           attn_logit_softcapping=0.1,
                           layer_types=["full_attention", "sliding_attention",
                                        "sliding_attention"])
    check_matches_transformers(model_dir)
    _assert_logprobs_match(model_dir)


def _config(family: str, **fields: Any) -> ModelConfig:
    arch = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[family]
    base = dict(architectures=[arch], vocab_size=256, hidden_size=64, intermediate_size=128,
                num_hidden_layers=12, num_attention_heads=4)
    return ModelConfig.from_hf_dict({**base, **fields})


def test_configs_without_layer_types_use_the_families_patterns():
    g2 = _config("gemma2")  # transformers' defaults: window 4096 on even layers, tied, 256
    assert g2.layer_windows == (4096, None) * 6
    assert g2.tie_word_embeddings and g2.head_dim == 256
    assert g2.hidden_act == "gelu_pytorch_tanh"
    g3 = _config("gemma3", sliding_window=512, rope_theta=1e6, rope_local_base_freq=1e4,
                 rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert g3.layer_windows == ((512,) * 5 + (None,)) * 2
    assert g3.rope_theta == 1e6 and g3.rope_scaling["factor"] == 8.0
    assert _config("gemma3", sliding_window_pattern=3).layer_windows[:3] == (4096, 4096, None)


@pytest.mark.parametrize("rope_fields", [
    dict(rope_theta=1e6, rope_local_base_freq=1e4,
         rope_scaling={"rope_type": "linear", "factor": 8.0}),  # transformers 4.x
    dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                             "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
], ids=["4.x", "5.x"])
def test_gemma3_layers_get_their_rope(rope_fields: dict[str, Any]):
    from pkv.core.models.gemma3 import Gemma3ForCausalLM
    from pkv.core.registry import select_attention_backend

    cfg = _config("gemma3", head_dim=16, **rope_fields)
    model = Gemma3ForCausalLM(cfg, select_attention_backend("torch", "cpu"), max_len=16)
    specs = [(layer.self_attn.rotary_emb.spec.theta, layer.self_attn.rotary_emb.spec.kind)
             for layer in model.model.layers]
    assert specs == ([(1e4, "default")] * 5 + [(1e6, "linear")]) * 2
    assert model.model.layers[0].self_attn.scale == 256**-0.5  # query_pre_attn_scalar


@pytest.mark.parametrize("family, field, value", [
    ("gemma2", "use_bidirectional_attention", True),
    ("gemma3", "use_bidirectional_attention", True),
    ("gemma2", "hidden_activation", "relu2"),
    ("gemma3", "rope_parameters", {"sliding_attention": {"rope_type": "yarn"}}),
])
def test_unsupported_fields_are_named(family: str, field: str, value: Any):
    with pytest.raises(ValueError, match=field):
        _config(family, **{field: value})


@pytest.mark.parametrize("with_kernel", [False, True], ids=["torch", "kernel"])
def test_gemma_rms_norm_scales_by_one_plus_weight(with_kernel: bool):
    from pkv.csrc import cpp_build

    norm = GemmaRMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 16))
    if with_kernel:
        norm.kernel = cpp_build.kernels_or_none()
        if norm.kernel is None:
            pytest.skip("no C++ compiler: the layer kernels are absent")
    x, residual = torch.randn(5, 16), torch.randn(5, 16)
    expected_sum = x + residual
    expected = expected_sum * torch.rsqrt(expected_sum.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = expected * (1 + norm.weight)
    torch.testing.assert_close(norm(expected_sum.clone()), expected)
    # per-head use (Gemma 3's q/k norm): a non-contiguous [T, H, D] view
    heads = torch.cat([expected_sum, expected_sum], dim=-1).view(5, 2, 16)[:, :1]
    torch.testing.assert_close(norm(heads)[:, 0], expected)
    out, res = norm.add_forward(x.clone(), residual.clone())
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(res, expected_sum)
