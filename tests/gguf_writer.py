"""A GGUF writer for tests: a tiny Hugging Face folder converted the way llama.cpp's
convert_hf_to_gguf.py converts each architecture, so that pkv's GGUF loader is tested against
the files people download, not against its own inverse.

Per architecture, as the converter does it (conversion/{llama,qwen,gemma,phi,olmo,granite}.py):
- llama (Llama, Mistral, Mixtral), granite, smollm3: q/k rows permuted for llama.cpp's RoPE,
  `rope.dimension_count`; Mixtral's experts stacked into `ffn_{gate,up,down}_exps`;
- gemma2 / gemma3: their own key set (no RoPE base for Gemma 2, no window pattern, no
  query_pre_attn_scalar), every `*norm.weight` stored as 1 + weight, Gemma 2's LM head dropped;
- phi3: fused `attn_qkv` / `ffn_up`, a window of 0 for none, LongRoPE factors as tensors;
- qwen3moe: experts stacked, `expert_feed_forward_length`;
- granite: head_dim dropped, multipliers written as scales.
One addition of ours: a Mistral/Mixtral `sliding_window` is written as
`llama.attention.sliding_window` (llama.cpp's converter drops it; llama.cpp runs no window
for the llama architecture).

Tensor names come from gguf-py's own TensorNameMap, as in the converter. Tokenizer metadata
is copied from another GGUF file (the bundled SmolLM2), whose vocabulary the tiny models use,
or written from given fields (a SentencePiece vocabulary: tests/models/test_gguf_tokenizers.py).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

GGUF_ARCHS = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe",
    "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2", "GraniteForCausalLM": "granite",
    "SmolLM3ForCausalLM": "smollm3", "BertModel": "bert",
}
# LlamaModel and its subclasses in the converter (undo_permute = True)
_PERMUTED = {"LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
             "GraniteForCausalLM", "SmolLM3ForCausalLM"}
_LLAMA_SHAPED = _PERMUTED


def write_gguf(model_dir: Path, out: Path, quant: str, tokenizer_gguf: Path | None = None,
               *, tokenizer_fields: dict[str, Any] | None = None,
               extra_fields: dict[str, Any] | None = None) -> Path:
    """Write the HF folder `model_dir` as GGUF at `out` the way llama.cpp converts its
    architecture; tensors of 2+ dims in `quant` (F32, F16, Q8_0, ..., Q4_K_M), tokenizer metadata
    copied from `tokenizer_gguf`, or `tokenizer_fields` (GGUFWriter method -> value) when
    given; `extra_fields` (likewise) for what a converter writes of some checkpoints only
    (`add_pooling_type` of an embedding model's)."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    hf_arch = cfg["architectures"][0]
    writer = gguf.GGUFWriter(str(out), GGUF_ARCHS[hf_arch])
    _write_metadata(writer, hf_arch, cfg)
    for key, value in (extra_fields or {}).items():
        getattr(writer, key)(value)
    if hf_arch == "BertModel":
        _bert_metadata(writer, model_dir, cfg)
        tokenizer_fields = {}  # the vocabulary comes from the folder, as the converter's
    if tokenizer_fields is None:
        if tokenizer_gguf is None:
            raise ValueError("write_gguf needs tokenizer_gguf or tokenizer_fields")
        tokenizer_fields = _tokenizer_fields(str(tokenizer_gguf))
    for key, value in tokenizer_fields.items():
        getattr(writer, key)(value)
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == GGUF_ARCHS[hf_arch])
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    for name, data in _converted_tensors(hf_arch, cfg, _load_state(model_dir)):
        gname = name if name.startswith("rope_factors_") else names.get_name(
            name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise ValueError(f"gguf-py maps no {hf_arch} tensor named {name!r}")
        kind = tensor_type(gname, quant)
        if data.ndim >= 2 and kind != "F32":
            writer.add_tensor(gname, quantize(data, kind),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            writer.add_tensor(gname, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def quantized_copy(model_dir: Path, out: Path, quant: str) -> Path:
    """A copy of the HF folder whose tensors of 2+ dims went through `quant` and back (gguf-py's
    quantize / dequantize): the weights a `quant` GGUF of the model holds, for a reference
    run in transformers."""
    import shutil

    import gguf
    from safetensors.torch import save_file

    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    state = {}
    for name, tensor in _load_state(model_dir).items():
        data = tensor.float().numpy()
        if data.ndim >= 2:
            kind = tensor_type(name, quant)
            data = gguf.quants.dequantize(quantize(data, kind), gguf.GGMLQuantizationType[kind])
        state[name] = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# A Q4_K_M-like mix: llama-quantize's Q4_K_M gives attn_v, ffn_down and the LM head Q6_K
# (here in every layer) and the rest Q4_K. Names of either side (GGUF or Hugging Face).
_SIX_BIT = ("attn_v", "ffn_down", "v_proj", "down_proj", "lm_head")


def tensor_type(name: str, quant: str) -> str:
    """The ggml type of tensor `name` in a file of `quant` (a type, or the mix "Q4_K_M")."""
    if quant != "Q4_K_M":
        return quant
    six = name == "output.weight" or any(part in name for part in _SIX_BIT)
    return "Q6_K" if six else "Q4_K"


def quantize(data: np.ndarray, quant: str) -> np.ndarray:
    """`data` [rows, cols] in ggml type `quant`: gguf-py's quantizer, or for the K-quants it
    lacks (Q4_K, Q6_K) a plain one: per-block scales from the extremes, codes rounded to
    nearest (llama.cpp searches for better scales; any valid blocks do for the tests)."""
    import gguf

    if quant == "Q4_K":
        return _q4_k(data.astype(np.float32))
    if quant == "Q6_K":
        return _q6_k(data.astype(np.float32))
    return gguf.quants.quantize(data, gguf.GGMLQuantizationType[quant])


def _halves(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape[:-1], 2)


def _q4_k(data: np.ndarray) -> np.ndarray:
    """Q4_K: 8 sub-blocks of 32 under 6-bit scales and mins, weight = d sc q - dmin m."""
    rows = data.shape[0]
    x = data.reshape(-1, 8, 32)
    low, high = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    scale, mins = (high - low) / 15, -low
    d = np.maximum(scale.max(-1, keepdims=True) / 63, 1e-4).astype(np.float16)
    dmin = np.maximum(mins.max(-1, keepdims=True) / 63, 1e-4).astype(np.float16)
    sc = np.clip(np.rint(scale / d.astype(np.float32)), 0, 63).astype(np.uint8)
    mq = np.clip(np.rint(mins / dmin.astype(np.float32)), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32) * sc)[..., None]
    shifted = x + (dmin.astype(np.float32) * mq)[..., None]
    q = np.clip(np.rint(np.divide(shifted, step, out=np.zeros_like(x), where=step > 0)),
                0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
    packed = np.empty((x.shape[0], 12), np.uint8)  # ggml's get_scale_min_k4, inverted
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mq[:, :4] | ((mq[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((mq[:, 4:] & 0xF) << 4)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([_halves(d), _halves(dmin), packed, qs], axis=1)
    return blocks.reshape(rows, -1)


def _q6_k(data: np.ndarray) -> np.ndarray:
    """Q6_K: 16 sub-blocks of 16 under int8 scales, weight = d sc (q - 32)."""
    rows = data.shape[0]
    x = data.reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = np.maximum(scale.max(-1, keepdims=True) / 127, 1e-4).astype(np.float16)
    sc = np.clip(np.rint(scale / d.astype(np.float32)), 0, 127).astype(np.int8)
    step = (d.astype(np.float32) * sc)[..., None]
    q = np.clip(np.rint(np.divide(x, step, out=np.zeros_like(x), where=step > 0)), -32, 31)
    q = (q + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [block, half, run, value]
    ql = np.concatenate([q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4,
                         q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4], axis=2).reshape(-1, 128)
    qh = (q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4
          | (q[:, :, 3] >> 4) << 6).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), _halves(d)], axis=1)
    return blocks.reshape(rows, -1)


def _load_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def _rope(cfg: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """The RoPE settings of a config of either transformers generation."""
    params = dict(cfg.get("rope_scaling") or {})
    if cfg.get("rope_theta") is not None:
        params.setdefault("rope_theta", cfg["rope_theta"])
    rope = cfg.get("rope_parameters") or {}
    if layer_type in rope:  # Gemma 3: one set per layer type
        rope = rope[layer_type] or {}
    params.update(rope)
    return params


# --- metadata: each converter's set_gguf_parameters ------------------------------------------

def _write_metadata(w: Any, hf_arch: str, cfg: dict[str, Any]) -> None:
    if hf_arch == "BertModel":
        return  # _bert_metadata, which needs the folder
    if hf_arch == "Gemma2ForCausalLM":
        _gemma_common(w, cfg)
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    elif hf_arch == "Gemma3ForCausalLM":
        _gemma_common(w, cfg)
        rope = _rope(cfg)
        w.add_rope_freq_base(rope.get("rope_theta", 1_000_000.0))
        w.add_sliding_window(cfg["sliding_window"])
        if rope.get("rope_type", "default") != "default":
            assert rope["rope_type"] == "linear"
            w.add_rope_scaling_type(_scaling("LINEAR"))
            w.add_rope_scaling_factor(rope["factor"])
    elif hf_arch == "Phi3ForCausalLM":
        _phi3_metadata(w, cfg)
    else:
        if hf_arch == "GraniteForCausalLM":
            cfg = {k: v for k, v in cfg.items() if k != "head_dim"}
        _base_metadata(w, cfg)
        if hf_arch in _LLAMA_SHAPED:
            _llama_metadata(w, hf_arch, cfg)
        if hf_arch == "Qwen3MoeForCausalLM":
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if hf_arch == "GraniteForCausalLM":
            for key, method in [("attention_multiplier", "add_attention_scale"),
                                ("embedding_multiplier", "add_embedding_scale"),
                                ("residual_multiplier", "add_residual_scale"),
                                ("logits_scaling", "add_logit_scale")]:
                if cfg.get(key):
                    getattr(w, method)(cfg[key])


def _bert_metadata(w: Any, model_dir: Path, cfg: dict[str, Any]) -> None:
    """conversion/bert.py's BertModel: TextModel's fields for an encoder, non-causal, the
    pooling sentence-transformers' files name, and the vocabulary in "phantom space" form
    (a word-initial piece `w` as `▁w`, a continuation `##w` as `w`) with the special ids."""
    import gguf
    import transformers

    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_causal_attention(False)
    modules = model_dir / "modules.json"
    if modules.is_file():
        path = next(m["path"] for m in json.loads(modules.read_text())
                    if m["type"].endswith("Pooling"))
        pooling = json.loads((model_dir / path / "config.json").read_text())
        kind = ("MEAN" if pooling.get("pooling_mode_mean_tokens") else "CLS"
                if pooling.get("pooling_mode_cls_token") else "LAST")
        w.add_pooling_type(gguf.PoolingType[kind])
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    special = set(tok.all_special_tokens)
    tokens = [by_id[i] for i in range(len(by_id))]
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    w.add_token_type_count(cfg.get("type_vocab_size", 1))
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list([t if k == gguf.TokenType.CONTROL else t[2:] if t.startswith("##")
                      else "\u2581" + t for t, k in zip(tokens, types)])
    w.add_token_types(types)
    gguf.SpecialVocab(model_dir, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


def _scaling(kind: str) -> Any:
    import gguf

    return gguf.RopeScalingType[kind]


def _base_metadata(w: Any, cfg: dict[str, Any]) -> None:
    """TextModel.set_gguf_parameters."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    rope = _rope(cfg)
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        w.add_rope_scaling_type(_scaling("LINEAR"))
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(_scaling("YARN"))
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])


def _llama_metadata(w: Any, hf_arch: str, cfg: dict[str, Any]) -> None:
    """LlamaModel.set_gguf_parameters, plus the window (ours, see the module docstring)."""
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg.get("head_dim")
                               or cfg["hidden_size"] // cfg["num_attention_heads"])
    if hf_arch in ("MistralForCausalLM", "MixtralForCausalLM") and cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])


def _gemma_common(w: Any, cfg: dict[str, Any]) -> None:
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])


def _phi3_metadata(w: Any, cfg: dict[str, Any]) -> None:
    """Phi3MiniModel.set_gguf_parameters (the LongRoPE factors are tensors, see below)."""
    rope = _rope(cfg)
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    partial = rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(int(partial * hidden) // heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope.get("rope_type", "default") in ("longrope", "su"):
        original = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)


# --- tensors: each converter's modify_tensors -------------------------------------------------

def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _converted_tensors(hf_arch: str, cfg: dict[str, Any],
                       state: dict[str, torch.Tensor]) -> Iterator[tuple[str, np.ndarray]]:
    """(HF or GGUF name, data) of every tensor the converter writes."""
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    experts: dict[str, np.ndarray] = {}
    for name, tensor in state.items():
        data = tensor.float().numpy()
        if "rotary_emb.inv_freq" in name or name.startswith("pooler."):
            continue  # (BERT's converter drops the pooler: embeddings do not use it)
        if hf_arch == "Gemma2ForCausalLM" and name == "lm_head.weight":
            continue  # tied in every Gemma 2; the converter drops it
        if hf_arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM") and name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        if hf_arch in _PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = _llama_permute(data, heads)
        elif hf_arch in _PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = _llama_permute(data, kv_heads)
        if ".experts." in name:
            experts[name] = data
            continue
        yield name, data
    yield from _stacked_experts(hf_arch, cfg, experts)
    if hf_arch == "Phi3ForCausalLM":
        rope = _rope(cfg)
        if rope.get("rope_type", "default") in ("longrope", "su"):
            yield "rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32)
            yield "rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32)


def _stacked_experts(hf_arch: str, cfg: dict[str, Any],
                     experts: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """Per-expert tensors stacked into one [E, ...] tensor per layer and part, under the
    merged names the converter maps."""
    if not experts:
        return
    if hf_arch == "MixtralForCausalLM":
        count, block, parts = cfg["num_local_experts"], "block_sparse_moe", ("w1", "w2", "w3")
    else:
        count = cfg.get("num_experts") or cfg["num_local_experts"]
        block, parts = "mlp", ("down_proj", "gate_proj", "up_proj")
    for layer in range(cfg["num_hidden_layers"]):
        for part in parts:
            names = [f"model.layers.{layer}.{block}.experts.{e}.{part}.weight"
                     for e in range(count)]
            if names[0] not in experts:
                continue
            stacked = np.stack([experts.pop(n) for n in names])
            merged = (f"layers.{layer}.feed_forward.experts.{part}.weight"
                      if hf_arch == "MixtralForCausalLM"
                      else f"model.layers.{layer}.mlp.experts.{part}.weight")
            yield merged, stacked
    assert not experts, f"unconverted experts: {sorted(experts)[:3]}"


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(path: str) -> dict[str, Any]:
    """GGUFWriter method -> value for the tokenizer metadata of a GGUF file (read once)."""
    import gguf

    fields = gguf.GGUFReader(path).fields
    keys = {"add_tokenizer_model": "model", "add_tokenizer_pre": "pre", "add_token_list": "tokens",
            "add_token_types": "token_type", "add_token_merges": "merges",
            "add_bos_token_id": "bos_token_id", "add_eos_token_id": "eos_token_id"}
    out = {method: fields[f"tokenizer.ggml.{key}"].contents() for method, key in keys.items()}
    out["add_chat_template"] = fields["tokenizer.chat_template"].contents()
    return out


def write_fields_gguf(path: Path, arch: str, fields: dict[str, Any]) -> Path:
    """A GGUF holding only metadata (a tokenizer's, say): each GGUFWriter method of `fields`
    called with its value, in order, and no tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for method, value in fields.items():
        getattr(writer, method)(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
