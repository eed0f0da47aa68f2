"""Mixture of experts: SparseMoE's grouped routing against a direct per-token reference,
both checkpoint layouts, Qwen3-MoE and Mixtral token for token against transformers, and
an out-of-range `num_experts_per_tok` refused before any weights load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pkv import LLM
from pkv.core.distributed.parallel import ShardPlan, TPGroup
from pkv.core.layers.mlp import ACTIVATIONS
from pkv.core.layers.moe import SparseMoE
from pkv.core.models.config import ModelConfig
from pkv.tests.helpers import build_tiny_model, check_matches_transformers
from pkv.tests.models.test_qwen3 import randomize_norms

HIDDEN, EXPERTS, TOP_K, WIDTH = 32, 4, 2, 24
PLAN = ShardPlan(tp=TPGroup(), kv_heads=(0, 1), q_heads=(0, 1), intermediate=(0, WIDTH),
                 vocab=(0, 1), vocab_sizes=[1], moe_intermediate=(0, WIDTH))


def random_moe(renormalize: bool, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(HIDDEN, EXPERTS, TOP_K, (0, WIDTH), "silu", renormalize, PLAN)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.3 * torch.randn(p.shape))
    return moe.requires_grad_(False)  # as build_model leaves it


def per_token_reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """For each token: softmax router, top-k, the weighted sum of its experts' MLPs."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ moe.gate.weight.T, dim=-1)
        weights, experts = torch.topk(probs, moe.top_k)
        if moe.renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), experts.tolist()):
            gate, up = moe.w13[e, :WIDTH], moe.w13[e, WIDTH:]
            out[t] += w * (moe.w2[e] @ (F.silu(gate @ x[t]) * (up @ x[t])))
    return out


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("tokens", [1, 2, 7, 33])
def test_routing_matches_per_token_reference(renormalize: bool, tokens: int) -> None:
    moe = random_moe(renormalize)
    x = torch.randn(tokens, HIDDEN)
    with torch.inference_mode():
        got, want = moe(x), per_token_reference(moe, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if tokens == 33:  # the tokens really spread over the experts
        assert len(moe.route(x)[1].unique()) == EXPERTS


@pytest.mark.parametrize("tokens", [1, 7, 33, 120])
def test_the_kernels_path_matches_per_token_reference(cpu_kernels, tokens: int) -> None:  # noqa: ANN001
    # Experts' rows through the kernels' f32_linear: the GEMV at few rows, oneDNN above (120
    # tokens x top-2 over 4 experts: ~60 rows an expert).
    moe = random_moe(renormalize=True, seed=tokens)
    x = torch.randn(tokens, HIDDEN)
    with torch.inference_mode():
        want = per_token_reference(moe, x)
        moe.kernel = cpu_kernels
        got = moe(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    counts = torch.bincount(moe.route(x)[1].flatten(), minlength=EXPERTS)
    if tokens == 120:
        assert counts.max() > cpu_kernels.f32_gemv_max_rows  # some expert took the GEMM


def test_per_expert_and_stacked_checkpoints_load_alike() -> None:
    src = random_moe(False, seed=1)
    w13, w2 = src.w13.detach(), src.w2.detach()
    per_expert, stacked = random_moe(False, seed=2), random_moe(False, seed=3)
    per_expert.load_checkpoint("gate.weight", src.gate.weight.detach(), "gate")
    stacked.load_checkpoint("gate.weight", src.gate.weight.detach(), "gate")
    for e in range(EXPERTS):  # Mixtral's names: w1 gate, w3 up, w2 down
        for part, tensor in (("w1", w13[e, :WIDTH]), ("w3", w13[e, WIDTH:]), ("w2", w2[e])):
            per_expert.load_checkpoint(f"experts.{e}.{part}.weight", tensor, part)
    stacked.load_checkpoint("experts.gate_up_proj", w13, "gate_up_proj")
    stacked.load_checkpoint("experts.down_proj", w2, "down_proj")
    for moe in (per_expert, stacked):
        assert moe.missing() == []
        torch.testing.assert_close(moe.w13, src.w13, rtol=0, atol=0)
        torch.testing.assert_close(moe.w2, src.w2, rtol=0, atol=0)


QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 decoder_sparse_step=1, head_dim=32)


@pytest.mark.parametrize("arch,overrides", [
    ("qwen3_moe", QWEN3_MOE),
    ("qwen3_moe", dict(QWEN3_MOE, mlp_only_layers=[0], norm_topk_prob=True)),
    # unlike Qwen3, transformers' Qwen3-MoE windows every layer
    ("qwen3_moe", dict(QWEN3_MOE, use_sliding_window=True, sliding_window=8)),
    # a window shorter than the prompts (9-70 tokens)
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16)),
], ids=["qwen3-moe", "qwen3-moe-dense-layer0", "qwen3-moe-window", "mixtral-window"])
def test_moe_models_match_transformers(tmp_path: Path, smol_hf_dir: Path, arch: str,
                                       overrides: dict) -> None:
    from pkv.core.model_loader.loader import open_model

    model_dir = build_tiny_model(tmp_path / arch, smol_hf_dir, arch, **overrides)
    randomize_norms(model_dir)
    cfg = open_model(str(model_dir)).config
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (4, 2)
    if "sliding_window" in overrides:
        window = overrides["sliding_window"]
        assert cfg.layer_windows == (window, window)
    check_matches_transformers(model_dir)


def test_top_k_beyond_the_experts_is_one_line_before_weights(tmp_path: Path,
                                                              smol_hf_dir: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "m", smol_hf_dir, "qwen3_moe", **QWEN3_MOE)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_experts_per_tok"] = 5
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 must be in \[1, 4\]") as err:
        ModelConfig.from_hf_dict(config)
    assert "\n" not in str(err.value)
    # the same from a folder whose weights are not even readable: the config fails first
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        LLM(str(model_dir), show_progress=False)


def test_quantized_experts_are_refused(tmp_path: Path, smol_hf_dir: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "m", smol_hf_dir, "mixtral", num_local_experts=4)
    with pytest.raises(ValueError, match="^MixtralForCausalLM experts do not run with fp8 "
                                         "weights: .*float only$"):
        LLM(str(model_dir), quantization="fp8", show_progress=False)


def test_mixtral_fields_a_config_leaves_out_are_transformers_defaults():
    from transformers import MixtralConfig

    from pkv.core.models.config import ModelConfig

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                 num_experts_per_tok=2)  # no rope_theta, no rms_norm_eps
    ours = ModelConfig.from_hf_dict({"architectures": ["MixtralForCausalLM"], **shape})
    theirs = MixtralConfig(**shape)
    assert (ours.rms_norm_eps, ours.rope_theta) == (theirs.rms_norm_eps,
                                                    theirs.rope_parameters["rope_theta"])


@pytest.mark.parametrize("float32_weights", [False, True])
def test_sixteen_bit_routing_weights_round_as_each_family_does(float32_weights: bool) -> None:
    """Mixtral (transformers) scales each expert's bfloat16 output by its float32 weight and
    rounds the product once; Qwen3-MoE rounds the weight to bfloat16 first."""
    moe = random_moe(True, seed=3).to(torch.bfloat16)
    moe.float32_weights = float32_weights
    x = torch.randn(33, HIDDEN).bfloat16()
    with torch.inference_mode():
        got = moe(x)
        weights, experts = moe.route(x)
        assert weights.dtype == (torch.float32 if float32_weights else torch.bfloat16)
        want = torch.zeros_like(x)
        act = ACTIVATIONS[moe.act]
        for e in range(EXPERTS):  # transformers' loop: experts in order, index_add per expert
            tokens, slot = torch.where(experts == e)
            if len(tokens):
                part = moe._expert(e, x[tokens], act) * weights[tokens, slot, None]
                want.index_add_(0, tokens, part.to(x.dtype))
    assert torch.equal(got, want)
