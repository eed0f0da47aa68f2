"""Builders for the models tests run on: tiny random HF models, GGUF files, HF references."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def build_tiny_model(out: Path, tokenizer_dir: Path, arch: str = "llama",
                     **overrides: Any) -> Path:
    """Save a small random Llama/Qwen2 (real safetensors + SmolLM2's tokenizer) into `out`."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        initializer_range=0.08)
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    torch.manual_seed(1234)
    model = model_cls(config_cls(**common)).eval()
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


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


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, out: Path, quant: str, tokenizer_gguf: Path) -> Path:
    """Write a Llama HF folder as GGUF the way llama.cpp does (Q/K permuted), 2-D weights in
    `quant`, tokenizer metadata copied from another GGUF file."""
    import gguf
    from safetensors.torch import load_file

    cfg = __import__("json").loads((model_dir / "config.json").read_text())
    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    qtype = gguf.GGMLQuantizationType[quant]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    for key, value in _tokenizer_fields(str(tokenizer_gguf)).items():
        getattr(writer, key)(value)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in state.items():
        base, kind = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            _, _, layer, rest = base.split(".", 3)
            gname = f"blk.{layer}.{parts[rest]}.{kind}"
        else:
            gname = f"{names[base]}.{kind}"
        data = tensor.float().numpy()
        if gname.endswith("attn_q.weight"):
            data = _llama_cpp_permute(data, cfg["num_attention_heads"])
        elif gname.endswith("attn_k.weight"):
            data = _llama_cpp_permute(data, cfg["num_key_value_heads"])
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gname, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


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
