"""float16 and bfloat16 checkpoints on CPU keep their weights in 16 bits (held as ggml's F16 /
BF16 blocks, widened in registers, float32 accumulation) and decode greedily as transformers
does in float32 on the same weights; `dtype=float32` still widens them at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pkv import LLM, SamplingParams
from pkv.tests.helpers import build_tiny_model, hf_greedy, parity_prompts

NEW_TOKENS = 12


def _sixteen_bit_copy(model_dir: Path, dtype: torch.dtype) -> Path:
    """The tiny model's weights rounded to `dtype`, config saying so (tied: the head shares
    the embedding's 16-bit table)."""
    path = model_dir / "model.safetensors"
    state = {name: t.to(dtype) for name, t in load_file(str(path)).items()}
    save_file(state, str(path), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize(("dtype", "label"), [(torch.bfloat16, "BF16"), (torch.float16, "F16")])
def test_sixteen_bit_weights_stay_sixteen_bit(tmp_path: Path, smol_hf_dir: Path,
                                              dtype: torch.dtype, label: str):
    from transformers import AutoModelForCausalLM

    model_dir = _sixteen_bit_copy(
        build_tiny_model(tmp_path / "hf", smol_hf_dir, "llama", tie_word_embeddings=True), dtype)
    prompts = parity_prompts(count=3)
    llm = LLM(str(model_dir), kv_cache_memory="16MiB", max_model_len=256, show_progress=False)
    try:
        runner = llm.llm_engine.runner
        by_type = runner.weight_bytes_by_type
        assert runner.model.model.fused is not None  # the C++ decoder runs the 16-bit linears
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    finally:
        llm.llm_engine.shutdown()
    assert by_type[label] > 50 * by_type.get("float32", 0)  # all but the norms
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf, prompts, NEW_TOKENS, 2)

    widened = LLM(str(model_dir), dtype="float32", kv_cache_memory="16MiB",
                  max_model_len=256, show_progress=False)
    try:
        assert set(widened.llm_engine.runner.weight_bytes_by_type) == {"float32"}
        assert widened.llm_engine.runner.weight_bytes >= 1.9 * sum(by_type.values())
    finally:
        widened.llm_engine.shutdown()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_sixteen_bit_experts_stay_sixteen_bit(tmp_path: Path, smol_hf_dir: Path, family: str):
    """Experts are most of a mixture's weights: kept as BF16 blocks too, not widened."""
    from transformers import AutoModelForCausalLM

    moe = (dict(num_local_experts=4) if family == "mixtral"
           else dict(num_experts=4, moe_intermediate_size=64))
    model_dir = _sixteen_bit_copy(build_tiny_model(
        tmp_path / "hf", smol_hf_dir, family, num_experts_per_tok=2, head_dim=32,
        tie_word_embeddings=True, **moe), torch.bfloat16)
    prompts = parity_prompts(count=3)
    llm = LLM(str(model_dir), kv_cache_memory="16MiB", max_model_len=256, show_progress=False)
    try:
        runner = llm.llm_engine.runner
        layer = runner.model.model.layers[0].mlp
        assert len(layer.expert_blocks) == 3 * layer.num_experts and layer.w13.numel() == 0
        by_type = runner.weight_bytes_by_type
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    finally:
        llm.llm_engine.shutdown()
    assert by_type["BF16"] > 50 * by_type.get("float32", 0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf, prompts, NEW_TOKENS, 2)


def test_a_sixteen_bit_encoder_stays_sixteen_bit(tmp_path: Path):
    """A bfloat16 BERT: its linears and word table in BF16 blocks, embeddings as transformers'
    in float32 on the same weights."""
    import torch.nn.functional as F
    import transformers

    from pkv.cli.bench.embed import write_random_bert

    shape = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 intermediate_size=128, vocab_size=1000, max_position_embeddings=128)
    folder = _sixteen_bit_copy(write_random_bert(tmp_path / "bert", shape, seed=3),
                               torch.bfloat16)
    texts = ["hello world", "w1 w2 w3, w4!", "the quick brown fox w17 w18 jumps"]
    llm = LLM(str(folder), show_progress=False)
    by_type = llm.llm_engine.runner.weight_bytes_by_type
    outs = llm.embed(texts)
    assert by_type["BF16"] > 5 * by_type["float32"]  # left in float32: positions, norms, biases
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.BertModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for out, text in zip(outs, texts):
            hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
            want = F.normalize(hidden.mean(0), dim=0)
            assert float(F.cosine_similarity(out.outputs.data, want, dim=0)) >= 0.9999
