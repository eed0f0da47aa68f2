"""Phi-3 / Phi-4-mini equal transformers token for token: fused checkpoint projections,
partial RoPE, LongRoPE's short and long factors, a sliding window."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pkv import LLM, SamplingParams
from pkv.tests.helpers import build_tiny_model, check_matches_transformers, parity_prompts

ROTARY_PAIRS = 6  # head_dim 16 (hidden / heads, as Phi-3's config checks) x 0.75 / 2
ORIGINAL = 32  # LongRoPE: sequences longer than this use the long factors
LONGROPE = dict(
    original_max_position_embeddings=ORIGINAL,  # max_position_embeddings 512: factor 16
    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.75,
                     "short_factor": [1.0 + 0.15 * i for i in range(ROTARY_PAIRS)],
                     "long_factor": [1.5 + 0.9 * i for i in range(ROTARY_PAIRS)],
                     "original_max_position_embeddings": ORIGINAL})
NEW_TOKENS = 16


def _prompts(crossing: bool) -> list[list[int]]:
    """Prompts whose sequences stay on one side of ORIGINAL while they decode (short: the
    short factors throughout; long: the long ones), or one that crosses it while decoding."""
    base = parity_prompts(count=6, shortest=9, longest=69)  # 9, 21, 33, 45, 57, 69 tokens
    if crossing:
        # 21 + 16 and 29 + 16 tokens cross; 9 + 16 stays short; 45 is long from the start
        return [base[1], base[0], base[2][:29], base[3]]
    return [base[0], base[1][:ORIGINAL - NEW_TOKENS], *base[2:]]


CASES = {
    # head_dim 32 != hidden / heads: 24 of its dims rotate
    "partial-rotary": dict(head_dim=32, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}),
    "window-mqa": dict(sliding_window=16, num_key_value_heads=1),
}


@pytest.mark.parametrize("name", CASES)
def test_phi3_matches_transformers(tmp_path: Path, smol_hf_dir: Path, name: str) -> None:
    model_dir = build_tiny_model(tmp_path / name, smol_hf_dir, "phi3", **CASES[name])
    check_matches_transformers(model_dir, NEW_TOKENS)


def test_phi3_longrope_matches_transformers(tmp_path: Path, smol_hf_dir: Path) -> None:
    """Prefills of up to 69 tokens, in chunks of 16 too, and preempted sequences recomputed:
    each sequence's table follows its whole length, not the chunk's."""
    model_dir = build_tiny_model(tmp_path / "longrope", smol_hf_dir, "phi3", **LONGROPE)
    check_matches_transformers(model_dir, NEW_TOKENS, prompts=_prompts(crossing=False))


def test_phi3_longrope_crossing_the_threshold(tmp_path: Path, smol_hf_dir: Path) -> None:
    # Sequences that outgrow original_max_position_embeddings while decoding are recomputed
    # with the long factors, as transformers recomputes them.
    model_dir = build_tiny_model(tmp_path / "longrope", smol_hf_dir, "phi3", **LONGROPE)
    check_matches_transformers(model_dir, NEW_TOKENS, prompts=_prompts(crossing=True))


def _fuse_like_phi3(llama_dir: Path, out: Path, output_dim: int) -> Path:
    """The Llama checkpoint in `llama_dir` as Phi-3 writes it: q/k/v and gate/up each one
    tensor, joined along the output axis (`output_dim`: 0 for float, 1 for AWQ)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(llama_dir / "model.safetensors"))
    fused: dict[str, torch.Tensor] = {}
    groups = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
              "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    for name, tensor in state.items():  # q, k, v and gate, up come in checkpoint order
        path, _, leaf = name.rpartition(".")
        base, _, module = path.rpartition(".")
        if module not in groups:
            fused[name] = tensor
            continue
        key = f"{base}.{groups[module]}.{leaf}"
        parts = [state[f"{base}.{m}.{leaf}"] for m, g in groups.items() if g == groups[module]]
        fused[key] = torch.cat(parts, dim=output_dim if tensor.dim() > 1 else 0)
    out.mkdir()
    save_file(fused, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((llama_dir / "config.json").read_text())
    config.update(architectures=["Phi3ForCausalLM"], model_type="phi3")
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / name, out / name)
    return out


def _random_awq(model_dir: Path, group: int = 64) -> None:
    """Replace every projection of a float checkpoint with random 4-bit AWQ tensors."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    state, gen = load_file(str(path)), torch.Generator().manual_seed(3)
    for name in [n for n in state if n.endswith("_proj.weight")]:
        rows, cols = state.pop(name).shape  # [out, in]
        base = name.removesuffix("weight")
        state[base + "qweight"] = torch.randint(-2**31, 2**31, (cols, rows // 8),
                                                generator=gen, dtype=torch.int32)
        state[base + "qzeros"] = torch.randint(-2**31, 2**31, (cols // group, rows // 8),
                                               generator=gen, dtype=torch.int32)
        state[base + "scales"] = (0.02 * torch.rand(cols // group, rows, generator=gen)).half()
    save_file(state, str(path), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                     "zero_point": True, "version": "gemm"}
    (model_dir / "config.json").write_text(json.dumps(config))


def _greedy(model_dir: Path, **options: Any) -> list[list[int]]:
    llm = LLM(str(model_dir), show_progress=False, kv_cache_memory="16MiB", **options)
    try:
        outs = llm.generate(parity_prompts(count=3), SamplingParams(temperature=0,
                                                                    max_tokens=12))
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.llm_engine.shutdown()


def test_phi3_fused_awq_checkpoint_equals_llama(tmp_path: Path, smol_hf_dir: Path) -> None:
    """AWQ packs 8 outputs per int32 along dim 1: the fused tensors split there."""
    llama = build_tiny_model(tmp_path / "llama", smol_hf_dir, "llama")
    _random_awq(llama)
    phi3 = _fuse_like_phi3(llama, tmp_path / "phi3", output_dim=1)
    assert _greedy(phi3) == _greedy(llama)


def test_phi3_tp2_equals_tp1(tmp_path: Path, smol_hf_dir: Path) -> None:
    """Tensor parallelism slices the fused checkpoint tensors per part (q, k, v; gate, up)."""
    model_dir = build_tiny_model(tmp_path / "phi3", smol_hf_dir, "phi3")
    assert _greedy(model_dir, tensor_parallel_size=2) == _greedy(model_dir)


def test_other_families_switch_longrope_tables_for_new_tokens_only(tmp_path: Path,
                                                                   smol_hf_dir: Path) -> None:
    # transformers recomputes a sequence crossing the threshold with the long table for
    # Phi-3 only; Llama's cache keeps its short-rotated keys and the tokens past it take the
    # long table (pkv recomputed every family's).
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
               "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0, 4.0],
               "long_factor": [1.0, 1.5, 2, 3, 4, 5, 6, 8]}
    model_dir = build_tiny_model(tmp_path / "llama", smol_hf_dir, "llama", rope_scaling=scaling)
    prompts = [parity_prompts(1, 20, 20)[0], parity_prompts(1, 40, 40)[0]]  # across; past
    from transformers import AutoModelForCausalLM

    from pkv.tests.helpers import hf_greedy

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    llm = LLM(str(model_dir), kv_cache_memory="16MiB", show_progress=False)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                               ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == hf_greedy(hf, prompts, NEW_TOKENS, None)
