"""Builders for the models tests run on: tiny random HF models, GGUF files, HF references."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from pkv.core.models.registry import MODEL_TYPES
from pkv.tests.gguf_writer import write_gguf  # noqa: F401  (re-exported for older tests)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def build_tiny_model(out: Path, tokenizer_dir: Path, arch: str = "llama",
                     **overrides: Any) -> Path:
    """Save a small random model of family `arch` (real safetensors + SmolLM2's tokenizer)
    into `out`; `overrides` are config fields."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,  # some families default to ids beyond a tiny vocabulary (SmolLM3)
        initializer_range=0.08)
    common.update(overrides)
    config = transformers.AutoConfig.for_model(MODEL_TYPES[arch], **common)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def randomize_norms(model_dir: Path, seed: int = 5) -> None:
    """Give every norm weight of the saved model random values: transformers initializes
    them to ones, which would hide a mix-up of two norms."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in state.items():
        if "norm" in name:
            state[name] = 1 + 0.5 * torch.randn(tensor.shape, generator=gen)
    save_file(state, str(path), metadata={"format": "pt"})


def parity_prompts(count: int = 6, shortest: int = 9, longest: int = 70) -> list[list[int]]:
    """Deterministic token-id prompts of `shortest`..`longest` tokens."""
    step = (longest - shortest) // max(1, count - 1)
    return [[(7 * i + 13 * j) % 49000 + 100 for j in range(shortest + step * i)]
            for i in range(count)]


def kv_block_bytes(model_dir: Path, block_size: int, one_group: bool = False
                   ) -> tuple[int, Any]:
    """(bytes of one float32 KV block, least(length, chunk): the fewest blocks the engine
    takes for max_model_len=length and max_num_batched_tokens=chunk) of `model_dir`'s model; a
    block holds one KV group's layers (core/layers/kv_groups.py): a global group must fit one
    sequence of max_model_len, a windowed one its window and a chunk. `one_group`: all layers
    in one table, as a draft model keeps them."""
    from pkv.core.layers.kv_groups import plan_kv_groups
    from pkv.core.model_loader.loader import open_model

    cfg = open_model(str(model_dir)).config
    groups = plan_kv_groups([None] * cfg.num_hidden_layers if one_group else cfg.layer_windows)
    per_block = 2 * groups.slots * block_size * cfg.num_key_value_heads * cfg.head_dim

    def least(length: int, chunk: int) -> int:
        full = -(-length // block_size)
        return sum(full if g.window is None else min(full, -(-(g.window + chunk) // block_size) + 1)
                   for g in groups.groups)

    return per_block * 4, least


def check_matches_transformers(model_dir: Path, new_tokens: int = 16,
                               prompts: list[list[int]] | None = None,
                               eos_token_id: int | None = 2,
                               speculative_config: dict[str, Any] | None = None) -> None:
    """Greedy pkv output equals transformers' (eager attention, float32) on `model_dir`,
    under batching, chunked prefill with small blocks (on the torch attention backend and the
    Python layer loop), a pool small enough to preempt, and prefix-cache hits on a repeated
    prompt; with `speculative_config`, every run speculates (and must have drafted)."""
    from transformers import AutoModelForCausalLM

    from pkv import LLM, SamplingParams

    prompts = prompts or parity_prompts()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    reference = hf_greedy(hf, prompts, new_tokens, eos_token_id)
    assert any(len(r) == new_tokens for r in reference)  # the reference really decoded
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    longest, block = max(map(len, prompts)) + new_tokens, 4
    per_block, least = kv_block_bytes(model_dir, block)
    draft = (speculative_config or {}).get("model")
    if draft:  # the draft's KV of each block comes out of the same memory
        per_block += kv_block_bytes(Path(draft), block, one_group=True)[0]
    # The least the engine takes (one sequence of max_model_len in steps of 16 tokens), a
    # fraction of what all the sequences hold at their longest: some must wait or be preempted.
    max_len = longest + 8
    small_pool = per_block * least(max_len, 16)
    # The C++ path (fused decoder stack, cpu attention) by default; the Python layer loop
    # and the torch reference backend with chunked prefill.
    runs = [dict(), dict(block_size=block, max_num_batched_tokens=16, attention_backend="torch"),
            dict(block_size=block, kv_cache_memory=small_pool, max_model_len=max_len,
                 max_num_batched_tokens=16)]
    for i, options in enumerate(runs):
        options.setdefault("kv_cache_memory", "16MiB")
        if speculative_config is not None:
            options["speculative_config"] = speculative_config
        llm = LLM(str(model_dir), show_progress=False, **options)
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == reference, options
        stats = llm.llm_engine.get_stats()
        assert stats.num_blocks_used == 0, options
        if speculative_config is not None:
            assert llm.llm_engine.spec_stats.num_draft_tokens > 0, options
        if options.get("kv_cache_memory") == small_pool:
            assert stats.num_preemptions > 0, options
        if i == 0:  # prefix cache: the same prompts again reuse their blocks
            again = llm.generate(prompts, params)
            assert [o.outputs[0].token_ids for o in again] == reference
            assert sum(o.num_cached_tokens for o in again) > 0
        llm.llm_engine.shutdown()


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int,
              eos_token_id: int | None) -> list[list[int]]:
    """Reference: transformers greedy decoding, one prompt at a time, cut after EOS."""
    outs = []
    for ids in prompts:
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), max_new_tokens=max_new_tokens,
                                 min_new_tokens=0, do_sample=False, pad_token_id=0,
                                 eos_token_id=eos_token_id)
        new = seq[0, len(ids):].tolist()
        if eos_token_id is not None and eos_token_id in new:
            new = new[:new.index(eos_token_id) + 1]
        outs.append(new)
    return outs


def make_lora_adapter(base_dir: Path, out: Path, rank: int, targets: list[str], seed: int,
                      alpha: float | None = None, rslora: bool = False) -> Any:
    """Save a random (non-zero) PEFT LoRA adapter for the model in `base_dir` into `out`;
    return transformers' base model with that adapter merged (`W + scale * B @ A`), the
    reference for greedy parity."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                attn_implementation="eager")
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets,
                        lora_dropout=0.0, init_lora_weights=False, use_rslora=rslora)
    model = get_peft_model(base, config)
    with torch.no_grad():  # large enough to change what greedy decoding picks
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5 / rank ** 0.5)
    model.save_pretrained(out)
    return model.merge_and_unload().eval()


def save_headless_qwen3(out: Path, tokenizer_dir: Path, num_hidden_layers: int = 2) -> Path:
    """A tiny random Qwen3 saved as the bare decoder (`Qwen3Model`: no LM head, no
    `model.`), as embedding checkpoints are, with `tokenizer_dir`'s tokenizer."""
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128,
        num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    torch.manual_seed(7)
    transformers.Qwen3Model(config).eval().save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out
