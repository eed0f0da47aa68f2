"""GGUF for every family: a tiny random HF model, converted as llama.cpp converts its
architecture (tests/gguf_writer.py), loads in pkv with the HF folder's config and decodes
greedily as transformers does on the HF folder (float32; Q8_0 against the Q8_0-rounded
weights). Configs hold only what a GGUF can say: see the loader's notes on what llama.cpp
fixes (Gemma's window pattern and attention scale, SmolLM3's RoPE-less layers)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pkv import LLM, SamplingParams
from pkv.csrc import cpp_build
from pkv.core.model_loader.loader import open_model
from pkv.core.models.config import ModelConfig
from pkv.tests.gguf_writer import quantized_copy, write_gguf
from pkv.tests.helpers import build_tiny_model, hf_greedy, parity_prompts

ROTARY_PAIRS = 6  # Phi-3: head_dim 16 x partial_rotary_factor 0.75 / 2
MOE = dict(num_experts_per_tok=2, head_dim=32)  # top-2 of 4

# case -> (family, config overrides); windows shorter than the longest prompt (69 tokens)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral-window": ("mistral", dict(sliding_window=16, head_dim=32)),
    "qwen2": ("qwen2", dict(num_key_value_heads=1)),
    "qwen3": ("qwen3", dict(head_dim=32)),
    # every layer MoE, renormalized top-k: all gguf-py's qwen3moe tensor names can hold
    "qwen3_moe": ("qwen3_moe", dict(MOE, num_experts=4, moe_intermediate_size=32,
                                    norm_topk_prob=True, num_key_value_heads=1)),
    "mixtral-window": ("mixtral", dict(MOE, num_local_experts=4, sliding_window=16)),
    # layer 0 and 2 sliding (llama.cpp's pattern 2), caps small enough to clip; tied, as
    # the converter drops Gemma 2's LM head
    "gemma2": ("gemma2", dict(head_dim=32, sliding_window=8, num_hidden_layers=3,
                              tie_word_embeddings=True,
                              query_pre_attn_scalar=32, attn_logit_softcapping=0.5,
                              final_logit_softcapping=5.0)),
    # pattern 6 over 7 layers: layer 5 global; linear x8 RoPE on it only; untied, MQA
    "gemma3": ("gemma3", dict(head_dim=32, sliding_window=8, num_hidden_layers=7,
                              query_pre_attn_scalar=32, num_key_value_heads=1,
                              tie_word_embeddings=False, rope_parameters={
                                  "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                     "rope_theta": 1_000_000.0},
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 10000.0}})),
    # partial rotary, LongRoPE (prompts past 32 tokens take the long factors), window, MQA
    "phi3": ("phi3", dict(sliding_window=16, num_key_value_heads=1,
                          original_max_position_embeddings=32, rope_parameters={
                              "rope_type": "longrope", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.75,
                              "short_factor": [1.0 + 0.15 * i for i in range(ROTARY_PAIRS)],
                              "long_factor": [1.5 + 0.9 * i for i in range(ROTARY_PAIRS)],
                              "original_max_position_embeddings": 32})),
    # head_dim = hidden / heads: the converter drops Granite's head_dim
    "granite": ("granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                attention_multiplier=0.0625, logits_scaling=8.0,
                                num_key_value_heads=1)),
    "olmo2": ("olmo2", dict(head_dim=32, num_key_value_heads=1, tie_word_embeddings=True,
                            rope_theta=500000.0)),
    # layer 3 without RoPE: llama.cpp's fixed step of 4
    "smollm3": ("smollm3", dict(num_hidden_layers=4, head_dim=32, tie_word_embeddings=True,
                                pad_token_id=0)),
}
NEW_TOKENS = 12


def _greedy_pkv(path: Path, prompts: list[list[int]]) -> tuple[list[list[int]], ModelConfig]:
    """pkv's greedy tokens, and the config it ran."""
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=32, kv_cache_memory="16MiB",
              show_progress=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    llm.llm_engine.shutdown()
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.model_config


def _greedy_hf(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    reference = hf_greedy(hf, prompts, NEW_TOKENS, 2)
    assert any(len(r) == NEW_TOKENS for r in reference)  # the reference really decoded
    return reference


def _comparable(cfg: ModelConfig) -> dict[str, Any]:
    """The ModelConfig fields that must agree between a GGUF and its HF folder."""
    fields = dataclasses.asdict(cfg)
    for key in ("hf", "rope_scaling", "torch_dtype"):
        fields.pop(key)
    spec = cfg.rope_spec()
    fields["rope"] = (spec.kind, spec.theta, spec.rotary_dim)
    return fields


def _hf_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))


@pytest.mark.parametrize("case", CASES)
def test_gguf_matches_transformers(case: str, tmp_path: Path, smol_hf_dir: Path,
                                   smol_gguf: Path):
    family, overrides = CASES[case]
    model_dir = build_tiny_model(tmp_path / "hf", smol_hf_dir, family, **overrides)
    gguf_path = write_gguf(model_dir, tmp_path / f"{case}.gguf", "F32", smol_gguf)
    prompts = parity_prompts(count=3)
    tokens, config = _greedy_pkv(gguf_path, prompts)
    assert _comparable(config) == _comparable(_hf_config(model_dir))
    assert tokens == _greedy_hf(model_dir, prompts)


def test_q8_0_experts_and_permuted_qk_dequantize_exactly(tmp_path: Path, smol_hf_dir: Path,
                                                         smol_gguf: Path):
    # Mixtral: stacked expert tensors and permuted q/k rows, all quantized; the reference is
    # transformers on the same weights rounded through Q8_0 by gguf-py
    family, overrides = CASES["mixtral-window"]
    model_dir = build_tiny_model(tmp_path / "hf", smol_hf_dir, family, **overrides)
    gguf_path = write_gguf(model_dir, tmp_path / "mixtral-q8.gguf", "Q8_0", smol_gguf)
    rounded = quantized_copy(model_dir, tmp_path / "hf-q8", "Q8_0")
    prompts = parity_prompts(count=3)
    assert _greedy_pkv(gguf_path, prompts)[0] == _greedy_hf(rounded, prompts)
    llm = LLM(str(gguf_path), kv_cache_memory="16MiB", max_model_len=128, show_progress=False)
    try:  # the experts stayed in their blocks: no float32 expert stacks
        runner = llm.llm_engine.runner
        moe = runner.model.model.layers[0].mlp
        assert len(moe.expert_blocks) == 3 * moe.num_experts and moe.w13.numel() == 0
        assert runner.weight_bytes_by_type["Q8_0"] > 20 * runner.weight_bytes_by_type["float32"]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_experts_partly_float_in_a_gguf_run_all_float(family: str, tmp_path: Path,
                                                      smol_hf_dir: Path, smol_gguf: Path):
    # Experts 48 wide: in an F16 file gate / up keep rows of whole 32-value blocks, down's
    # rows of 48 cannot (float32 as they load), in the file's order (Qwen3-MoE's down first)
    width = ({"moe_intermediate_size": 48, "num_experts": 4, "norm_topk_prob": True}
             if family == "qwen3_moe"
             else {"intermediate_size": 48, "num_local_experts": 4})
    model_dir = build_tiny_model(tmp_path / "hf", smol_hf_dir, family, **MOE, **width)
    gguf_path = write_gguf(model_dir, tmp_path / "f16.gguf", "F16", smol_gguf)
    rounded = quantized_copy(model_dir, tmp_path / "hf-f16", "F16")
    prompts = parity_prompts(count=3)
    assert _greedy_pkv(gguf_path, prompts)[0] == _greedy_hf(rounded, prompts)


def test_float32_dequantizes_a_ggufs_experts_too(tmp_path: Path, smol_hf_dir: Path,
                                                 smol_gguf: Path):
    family, overrides = CASES["mixtral-window"]
    model_dir = build_tiny_model(tmp_path / "hf", smol_hf_dir, family, **overrides)
    gguf_path = write_gguf(model_dir, tmp_path / "mixtral-q8.gguf", "Q8_0", smol_gguf)
    llm = LLM(str(gguf_path), dtype="float32", kv_cache_memory="16MiB", max_model_len=128,
              show_progress=False)
    try:
        moe = llm.llm_engine.runner.model.model.layers[0].mlp
        assert not moe.expert_blocks and moe.w13.numel() > 0
        assert set(llm.llm_engine.runner.weight_bytes_by_type) == {"float32"}
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(("case", "quant"), [("mistral-window", "Q4_0"),
                                             ("mistral-window", "Q5_0"), ("qwen2", "Q4_1")])
def test_quantized_blocks_compute_as_their_dequantized_weights(
        tmp_path: Path, smol_hf_dir: Path, smol_gguf: Path, case: str, quant: str):
    # The weights stay in their blocks: 4-bit ones repacked for the 4-bit kernel (Q4_0 without
    # zero terms: 8 scales), Q5_0 in the generic block GEMV; both inside the C++ decoder. Qwen2
    # adds q/k/v biases.
    family, overrides = CASES[case]
    model_dir = build_tiny_model(tmp_path / "hf", smol_hf_dir, family, **overrides)
    gguf_path = write_gguf(model_dir, tmp_path / f"{case}-{quant}.gguf", quant, smol_gguf)
    rounded = quantized_copy(model_dir, tmp_path / f"hf-{quant}", quant)
    prompts = parity_prompts(count=3)
    llm = LLM(str(gguf_path), kv_cache_memory="32MiB", max_model_len=256,
              show_progress=False)
    try:
        labels = set(llm.llm_engine.runner.weight_bytes_by_type)
        assert llm.llm_engine.runner.model.model.fused is not None
        mlp = llm.llm_engine.runner.model.model.layers[0].mlp
        if quant.startswith("Q4"):
            held = 0 if quant == "Q4_0" else mlp.down_proj.scales.numel()
            assert mlp.down_proj.zs.numel() == held
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    finally:
        llm.llm_engine.shutdown()
    assert any(quant in label for label in labels), labels
    assert [o.outputs[0].token_ids for o in outs] == _greedy_hf(rounded, prompts)


def test_gemma_norms_lose_the_converters_one(tmp_path: Path, smol_hf_dir: Path,
                                             smol_gguf: Path):
    from safetensors.torch import load_file

    family, overrides = CASES["gemma3"]
    model_dir = build_tiny_model(tmp_path / "hf", smol_hf_dir, family, **overrides)
    gguf_path = write_gguf(model_dir, tmp_path / "gemma3.gguf", "F32", smol_gguf)
    loaded = dict(open_model(str(gguf_path)).weights())
    original = load_file(str(model_dir / "model.safetensors"))
    assert set(loaded) == set(original)
    for name in ("model.norm.weight", "model.layers.0.self_attn.q_norm.weight",
                 "model.layers.0.pre_feedforward_layernorm.weight"):
        torch.testing.assert_close(torch.as_tensor(loaded[name]), original[name],
                                   rtol=0, atol=1e-7)


def test_unsupported_gguf_architecture_is_one_line(tmp_path: Path):
    import gguf

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError) as err:
        open_model(str(path))
    message = str(err.value)
    assert "\n" not in message and "'mamba'" in message
    for arch in ("llama", "qwen3moe", "gemma3", "phi3", "bert"):
        assert arch in message
    writer = gguf.GGUFWriter(str(path), "bert")  # one pkv runs, without its fields
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="lacks bert.attention.head_count"):
        open_model(str(path))


def test_rope_scaling_pkv_lacks_is_named_not_dropped(tmp_path: Path, smol_hf_dir: Path,
                                                      smol_gguf: Path):
    # the converter writes Qwen's YaRN; pkv does not run it, so loading must say so
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 128}
    model_dir = build_tiny_model(tmp_path / "hf", smol_hf_dir, "qwen3", rope_parameters=yarn)
    gguf_path = write_gguf(model_dir, tmp_path / "yarn.gguf", "F32", smol_gguf)
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        open_model(str(gguf_path))


def test_k_quant_mix_computes_as_its_dequantized_weights(tmp_path: Path, smol_hf_dir: Path,
                                                         smol_gguf: Path):
    # A Q4_K_M-style file (Q4_K, with Q6_K attn_v / ffn_down / LM head) in the C++ decoder:
    # float activations equal transformers on the dequantized weights; int8 activations
    # (the K-quants' int8 GEMV, Q4_K kept as blocks) stay close to float and differ from it.
    from tests.quantization.test_fused_decoder import _one_sequence_meta

    model_dir = build_tiny_model(tmp_path / "hf", smol_hf_dir, "llama", hidden_size=256,
                                 intermediate_size=512, head_dim=64, num_attention_heads=4,
                                 num_key_value_heads=2, tie_word_embeddings=False)
    gguf_path = write_gguf(model_dir, tmp_path / "q4km.gguf", "Q4_K_M", smol_gguf)
    rounded = quantized_copy(model_dir, tmp_path / "hf-q4km", "Q4_K_M")
    prompts = parity_prompts(count=3)
    integer = cpp_build.kernels().awq_gemv_has_integer()
    hidden, labels = {}, {}
    for activations in ("float32", "int8") if integer else ("float32",):
        llm = LLM(str(gguf_path), kv_cache_memory="32MiB", max_model_len=256,
                  show_progress=False, awq_activations=activations)
        try:
            runner = llm.llm_engine.runner
            labels[activations] = set(runner.weight_bytes_by_type)
            assert runner.model.model.fused is not None
            if activations == "float32":
                outs = llm.generate(prompts, SamplingParams(temperature=0,
                                                            max_tokens=NEW_TOKENS))
            tokens = torch.tensor(prompts[0][:6])
            meta = _one_sequence_meta(len(tokens), runner.block_size)
            with torch.inference_mode():
                hidden[activations] = runner.model.model(tokens, torch.arange(len(tokens)),
                                                         runner.kv_caches, meta)
        finally:
            llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == _greedy_hf(rounded, prompts)
    assert {"Q4_K as 4-bit tiles", "Q6_K"} <= labels["float32"], labels
    if not integer:  # the generic flavour has no integer GEMVs: refused in one line
        with pytest.raises(ValueError, match="needs the avx2 or avx512 CPU kernels"):
            LLM(str(gguf_path), kv_cache_memory="32MiB", awq_activations="int8",
                show_progress=False)
        return
    assert {"Q4_K", "Q6_K"} <= labels["int8"], labels
    error = ((hidden["int8"] - hidden["float32"]).norm() / hidden["float32"].norm()).item()
    assert 0 < error < 5e-2, error
