"""The `gguf` weight loader: config, tokenizer and dequantized tensors of a GGUF file, under
Hugging Face names.

llama.cpp's converter permutes the rows of attn_q / attn_k of Llama models for its RoPE
layout; `_unpermute` restores Hugging Face's order so one model file serves both formats.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from pkv.core.model_config import ModelConfig
from pkv.core.model_loader import ModelSource, open_folder, write_tokenizer
from pkv.core.quantization import WeightLoader
from pkv.core.tokenizer import Tokenizer
from pkv.core.weight_cache import convert_while_loading, converted_folder

logger = logging.getLogger("pkv.gguf")

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K",
                    "Q5_K", "Q6_K", "Q8_K", "Q2_K", "Q3_K")
_CONTROL, _USER_DEFINED = 3, 4


def hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name (blk.3.attn_q.weight) to Hugging Face's (model.layers.3...)."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part not in _LAYER_NAMES:
            raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a Llama-family model")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base not in _GLOBAL_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a Llama-family model")
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


class GGUFFile:
    """An opened GGUF file; fields are read lazily, tensors dequantized on iteration."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as exc:  # the gguf package raises several types on bad files
            raise ValueError(f"{path} is not a readable GGUF file: {exc}") from None
        self.arch = str(self.field("general.architecture"))
        if self.arch not in _ARCHITECTURES:
            raise ValueError(f"GGUF architecture {self.arch!r} is not supported; pkv runs "
                             f"{', '.join(_ARCHITECTURES)}")

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def hf_config(self) -> dict[str, Any]:
        """The model's config.json equivalent."""
        a = self.arch
        heads = int(self.field(f"{a}.attention.head_count"))
        hidden = int(self.field(f"{a}.embedding_length"))
        names = {t.name for t in self.reader.tensors}
        rope_scale = self.field(f"{a}.rope.scaling.factor")
        rope_type = self.field(f"{a}.rope.scaling.type")
        return {
            "architectures": [_ARCHITECTURES[a]],
            "vocab_size": len(self.reader.fields["tokenizer.ggml.tokens"].data),
            "hidden_size": hidden,
            "intermediate_size": int(self.field(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self.field(f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(self.field(f"{a}.attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.field(f"{a}.rope.freq_base", 10000.0)),
            "rope_scaling": ({"rope_type": rope_type, "factor": float(rope_scale)}
                             if rope_type == "linear" and rope_scale else None),
            "max_position_embeddings": int(self.field(f"{a}.context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
        }

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensors)

    def tensor_specs(self) -> list[tuple[str, tuple[int, ...]]]:
        """(Hugging Face name, shape) of every tensor, in the order `tensors` yields them."""
        return [(hf_name(t.name), tuple(int(d) for d in reversed(t.shape)))
                for t in self.reader.tensors]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (Hugging Face name, float32 tensor) for every tensor in the file."""
        from gguf import GGMLQuantizationType, quants

        cfg = self.hf_config()
        for t in self.reader.tensors:
            type_name = GGMLQuantizationType(t.tensor_type).name
            if type_name not in _SUPPORTED_TYPES:
                raise ValueError(f"GGUF tensor {t.name} has type {type_name}, which pkv cannot "
                                 f"read ({', '.join(_SUPPORTED_TYPES)})")
            data = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            data = data.reshape(tuple(int(d) for d in reversed(t.shape)))
            name = hf_name(t.name)
            if self.arch != "qwen2" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
                data = _unpermute(data, cfg["num_attention_heads"])
            elif self.arch != "qwen2" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
                data = _unpermute(data, cfg["num_key_value_heads"])
            data = np.ascontiguousarray(data)
            if not data.flags.writeable:  # F32 tensors are views of the read-only file map
                data = data.copy()
            yield name, torch.from_numpy(data)

    def tokenizer(self) -> Tokenizer:
        """Build the tokenizer from tokenizer.ggml.* metadata (byte-level BPE models)."""
        kind = self.field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' BPE)")
        tokens: list[str] = self.field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in self.field("tokenizer.ggml.merges", [])]
        types = self.field("tokenizer.ggml.token_type", [1] * len(tokens))
        backend = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                         fuse_unk=False, ignore_merges=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if self.field("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "codeshell"):
            # These vocabularies split every digit on its own before the GPT-2 regex.
            byte_level = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([t for t, k in zip(tokens, types) if k == _CONTROL])
        backend.add_tokens([t for t, k in zip(tokens, types) if k == _USER_DEFINED])
        eos = self.field("tokenizer.ggml.eos_token_id")
        return Tokenizer(backend, bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
                         eos_token_ids={eos} if eos is not None else set(),
                         add_bos_token=bool(self.field("tokenizer.ggml.add_bos_token", False)),
                         chat_template=self.field("tokenizer.chat_template"))


class GGUFLoader(WeightLoader):
    """Reads .gguf files; weights are dequantized to the compute dtype while loading."""

    name = "gguf"

    def open(self, path: Path) -> ModelSource:
        """The converted copy from the cache (core/weight_cache.py) if there is one; else the
        GGUF itself, converted into the cache as its weights load."""
        folder = converted_folder(path)
        if folder.is_dir():
            try:
                return replace(open_folder(folder), path=path, name=path.stem,
                               quantization="gguf")
            except (ValueError, OSError) as exc:
                logger.warning("discarding the unreadable cached conversion %s: %s", folder, exc)
                shutil.rmtree(folder, ignore_errors=True)
        gguf_file = GGUFFile(path)
        hf_config = gguf_file.hf_config()
        tokenizer = gguf_file.tokenizer()

        def write_metadata(out: Path) -> None:
            (out / "config.json").write_text(json.dumps(hf_config, indent=2))
            write_tokenizer(out, tokenizer)

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            return convert_while_loading(gguf_file.tensors(), gguf_file.tensor_specs(), folder,
                                         write_metadata)

        return ModelSource(path=path, name=path.stem, config=ModelConfig.from_hf_dict(hf_config),
                           tokenizer=tokenizer, num_tensors=gguf_file.num_tensors,
                           weights=weights, hf_config=hf_config, quantization="gguf")
