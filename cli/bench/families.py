"""`pkv bench families`: decode speed of every family on random weights of one shape
(SmolLM2-135M's), each beside Llama's, and which code path computed it.

A family whose layer the C++ decoder stack expresses (core/worker/fused_decoder.py) should decode
within ~10% of Llama at the same shapes; the MoE families and LongRoPE take the Python
layer loop and say so. Weights are random (transformers' initialisation, saved once to a
temporary folder with the bundled tokenizer): speed does not depend on what they hold.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# SmolLM2-135M's shapes; each family adds what makes it itself.
BASE_SHAPE: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILY_SHAPES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": dict(sliding_window=1024),
    "qwen2": {},
    "qwen3": {},
    "smollm3": {},
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                    attention_multiplier=0.125, logits_scaling=4.0),
    "olmo2": {},
    "phi3": dict(partial_rotary_factor=0.75, tie_word_embeddings=False),
    "gemma2": dict(query_pre_attn_scalar=64, sliding_window=1024,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3": dict(query_pre_attn_scalar=64, sliding_window=512),
    # experts of half the dense width, two active: the same active MLP parameters
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768,
                      norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=768),
}


@dataclass
class FamilyRow:
    family: str
    path: str  # which code computed the decoder layers
    decode_tps: dict[int, float]  # batch -> decode tokens/s


def write_random_model(family: str, out: Path, shape: dict[str, Any] | None = None) -> Path:
    """A random-weight model of `family` at BASE_SHAPE (or `shape`), with the bundled
    tokenizer."""
    import torch

    try:
        import transformers
    except ImportError:
        raise ValueError("this benchmark builds its random models with transformers: "
                         "pip install 'pkv[dev]'") from None

    from pkv.core.model_loader.loader import open_model, write_tokenizer
    from pkv.core.models.registry import MODEL_TYPES

    config = transformers.AutoConfig.for_model(MODEL_TYPES[family],
                                               **{**BASE_SHAPE, **FAMILY_SHAPES[family],
                                                  **(shape or {})})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    write_tokenizer(out, open_model(None).tokenizer)
    return out


def bench_family(family: str, batches: list[int], output_len: int, workdir: Path,
                 shape: dict[str, Any] | None = None) -> FamilyRow:
    from pkv.cli.bench import workload as off
    from pkv.cli.bench.engines import decoder_path
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm_engine import LLMEngine
    from pkv.core.sample.sampling_params import SamplingParams

    model_dir = write_random_model(family, workdir / family, shape)
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="2GiB",
                                    max_model_len=512), show_progress=False)
    vocab = list(range(100, 49000))
    for prompt in off.make_prompts(vocab, 4, 8, 1, None, engine.tokenizer.encode):
        engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=4))
    engine.generate_until_done()
    tps = {}
    for b in batches:
        prompts = off.make_prompts(vocab, max(b, 4), 32, 0, None, engine.tokenizer.encode)
        tps[b] = off.run_pkv(engine, prompts, output_len, b).decode_tps
    row = FamilyRow(family, decoder_path(engine), tps)
    engine.shutdown()
    return row


def bench_families(families: list[str], batches: list[int], output_len: int,
                   shape: dict[str, Any] | None = None) -> list[FamilyRow]:
    """One row per family; `shape` overrides BASE_SHAPE (tests use a tiny one)."""
    with tempfile.TemporaryDirectory(prefix="pkv-bench-families-") as tmp:
        return [bench_family(f, batches, output_len, Path(tmp), shape) for f in families]


def families_table(rows: list[FamilyRow], batches: list[int]) -> Any:
    from rich.table import Table

    base = next((r for r in rows if r.family == "llama"), None)
    table = Table(title="decode tokens/s on random weights of SmolLM2-135M's shape")
    table.add_column("family")
    for b in batches:
        table.add_column(f"batch {b}", justify="right")
        table.add_column("vs llama", justify="right")
    table.add_column("decoder path")
    for row in rows:
        cells = []
        for b in batches:
            ratio = row.decode_tps[b] / base.decode_tps[b] if base and base.decode_tps[b] else 0
            cells += [f"{row.decode_tps[b]:.1f}", f"{ratio:.2f}x" if base else "-"]
        table.add_row(row.family, *cells, row.path)
    return table
