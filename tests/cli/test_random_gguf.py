"""`pkv bench random-gguf`: a real shape's tensors in llama-quantize's Q4_K_M types, and a
small file of the same kind that pkv loads at its own size and decodes."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pkv.cli.bench.random_gguf import SHAPES, Shape, tensor_plan, write_random_gguf


def _bytes(dims: tuple[int, ...], kind: str) -> int:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    return int(np.prod(dims)) // block * size


def test_the_qwen_shape_takes_the_fallback_types_of_its_896_wide_rows():
    plan = {name: kind for name, _, kind in tensor_plan(SHAPES["qwen2.5-0.5b"])}
    # 896 is not a whole number of 256-value blocks: Q4_K -> Q5_0, Q6_K -> Q8_0
    assert plan["token_embd.weight"] == "Q5_0" and plan["output.weight"] == "Q8_0"
    assert plan["blk.0.attn_q.weight"] == "Q5_0" and plan["blk.0.ffn_up.weight"] == "Q5_0"
    assert plan["blk.0.attn_v.weight"] == "Q8_0"  # a layer given more bits
    assert plan["blk.3.attn_v.weight"] == "Q5_0"
    # ffn_down's rows are 4864 = 19 x 256 wide: K-quants
    assert plan["blk.0.ffn_down.weight"] == "Q6_K" and plan["blk.3.ffn_down.weight"] == "Q4_K"
    assert plan["blk.23.attn_k.bias"] == "F32"
    assert "blk.0.attn_output.bias" not in plan


def test_the_qwen_shape_is_the_size_of_the_file_people_download():
    plan = tensor_plan(SHAPES["qwen2.5-0.5b"])
    by_type: dict[str, int] = {}
    for _, dims, kind in plan:
        by_type[kind] = by_type.get(kind, 0) + _bytes(dims, kind)
    assert max(by_type, key=by_type.get) == "Q5_0"  # mostly Q5_0, as the real file
    # Qwen2.5-0.5B-Instruct's Q4_K_M file: 469 MiB, its tokenizer included
    assert 455 * 2**20 < sum(by_type.values()) < 469 * 2**20


def test_a_small_random_gguf_loads_in_its_blocks_and_decodes(tmp_path: Path):
    from pkv import LLM, SamplingParams

    shape = Shape(8, 320, 512, 5, 1, 49152, 1e6, 512, arch="qwen2", qkv_bias=True,
                  norm_eps=1e-6)
    path = tmp_path / "small.gguf"
    size = write_random_gguf(path, shape)
    assert size == path.stat().st_size
    llm = LLM(str(path), max_model_len=128, kv_cache_memory="16MiB", show_progress=False)
    runner = llm.llm_engine.runner
    kinds = set(runner.weight_bytes_by_type)
    assert {"Q5_0", "Q8_0"} <= kinds, kinds
    assert any(kind.startswith("Q4_K") for kind in kinds) and "Q6_K" in kinds, kinds
    assert runner.weight_bytes <= 1.15 * size
    out = llm.generate(["The quick brown fox"],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_an_unknown_shape_is_named_with_the_choices(tmp_path: Path):
    with pytest.raises(ValueError, match="qwen2.5-0.5b"):
        write_random_gguf(tmp_path / "x.gguf", "llama-9b")
