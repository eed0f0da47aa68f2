"""The `gguf` weight loader: config, tokenizer and dequantized tensors of a GGUF file, under
Hugging Face names, for every architecture string pkv runs.

A GGUF file is what llama.cpp's convert_hf_to_gguf.py made of a Hugging Face checkpoint; the
loader undoes that conversion (per architecture: plugins/weights/gguf_archs.py), so that one
model file serves both formats:

- `{arch}.*` metadata -> the config.json fields the family's model file reads;
- `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`;
- Llama-shaped converters permute the rows of q/k for llama.cpp's RoPE layout: `_unpermute`
  restores Hugging Face's order;
- Gemma's converter stores every `*norm.weight` as 1 + weight: the 1 comes off again;
- stacked experts `ffn_{gate,up,down}_exps` [E, ...] -> one tensor per expert, as
  checkpoints name them;
- Phi-3's LongRoPE factors are tensors (`rope_factors_long/short`): they go into the config.
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

from pkv.core.model_loader.loader import ModelSource, open_folder, write_tokenizer
from pkv.core.model_loader.quantization import WeightLoader
from pkv.core.model_loader.weight_cache import convert_while_loading, converted_folder
from pkv.core.models.config import ModelConfig
from pkv.core.tokenizer.tokenizer import Tokenizer
from pkv.plugins.weights.gguf_archs import (ARCHS, CONFIG_TENSORS, EXPERT_PARTS, GLOBAL_NAMES,
                                            LAYER_NAMES, decimal)
from pkv.plugins.weights.gguf_tokenizer import gguf_tokenizer

logger = logging.getLogger("pkv.gguf")

_SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K",
                    "Q5_K", "Q6_K", "Q8_K", "Q2_K", "Q3_K")


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
        if self.arch not in ARCHS:
            raise ValueError(f"GGUF architecture {self.arch!r} is not supported; pkv runs "
                             f"{', '.join(ARCHS)}")
        self.spec = ARCHS[self.arch]
        self.names = {t.name: t for t in self.reader.tensors}
        self._config: dict[str, Any] | None = None

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else decimal(f.contents())

    def key(self, name: str, default: Any = None) -> Any:
        """The architecture's field `{arch}.{name}`."""
        return self.field(f"{self.arch}.{name}", default)

    def hf_config(self) -> dict[str, Any]:
        """The model's config.json equivalent."""
        if self._config is None:
            cfg = self._common_config()
            if self.spec.fields is not None:
                self.spec.fields(self, cfg)
            self._config = cfg
        return self._config

    def _common_config(self) -> dict[str, Any]:
        heads = int(self.key("attention.head_count"))
        hidden = int(self.key("embedding_length"))
        head_dim = int(self.key("attention.key_length", hidden // heads))
        cfg: dict[str, Any] = {
            "architectures": [self.spec.hf_arch],
            "vocab_size": self.hf_shape("token_embd.weight")[0],
            "hidden_size": hidden,
            "intermediate_size": int(self.key("feed_forward_length")),
            "num_hidden_layers": int(self.key("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.key("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(self.key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_parameters": self.rope_parameters(),
            "max_position_embeddings": int(self.key("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self.names,
            "attention_bias": "blk.0.attn_q.bias" in self.names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
        }
        rotary = self.key("rope.dimension_count")
        if rotary is not None and int(rotary) != head_dim:
            cfg["partial_rotary_factor"] = int(rotary) / head_dim
        return cfg

    def rope_parameters(self, default_theta: float = 10000.0) -> dict[str, Any]:
        """RoPE base and scaling. An unknown scaling type (yarn) is kept, so that the config
        check names it instead of the model running without it."""
        params: dict[str, Any] = {"rope_type": "default",
                                  "rope_theta": float(self.key("rope.freq_base", default_theta))}
        kind = self.key("rope.scaling.type")
        if kind not in (None, "none"):
            params["rope_type"] = kind
            if (factor := self.key("rope.scaling.factor")) is not None:
                params["factor"] = float(factor)
            if (original := self.key("rope.scaling.original_context_length")) is not None:
                params["original_max_position_embeddings"] = int(original)
        if "rope_freqs.weight" in self.names:
            raise ValueError(f"{self.path.name}: Llama 3 RoPE scaling stored as per-frequency "
                             "factors (GGUF tensor rope_freqs.weight) is not supported")
        return params

    # --- tensors --------------------------------------------------------------------------

    def hf_shape(self, gguf_name: str) -> tuple[int, ...]:
        """Shape of a GGUF tensor in PyTorch order (GGUF lists dims fastest first)."""
        return tuple(int(d) for d in reversed(self.names[gguf_name].shape))

    def hf_names(self, gguf_name: str) -> list[str]:
        """The Hugging Face tensor(s) a GGUF tensor holds: one per expert for stacked ones."""
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
        if match is None:
            base, _, kind = gguf_name.rpartition(".")
            if base not in GLOBAL_NAMES:
                raise self._foreign(gguf_name)
            return [f"{GLOBAL_NAMES[base]}.{kind}"]
        layer, part, kind = match.groups()
        prefix = f"model.layers.{layer}"
        moe = self.spec.experts
        exps = re.fullmatch(r"ffn_(gate|up|down)_exps", part)
        if moe is not None and exps is not None:
            hf_part = moe[1][EXPERT_PARTS.index(exps.group(1))]
            count = self.hf_shape(gguf_name)[0]
            return [f"{prefix}.{moe[0]}.experts.{e}.{hf_part}.{kind}" for e in range(count)]
        if moe is not None and part == "ffn_gate_inp":
            return [f"{prefix}.{moe[0]}.{moe[2]}.{kind}"]
        module = self.spec.names.get(part) or LAYER_NAMES.get(part)
        if module is None:
            raise self._foreign(gguf_name)
        return [f"{prefix}.{module}.{kind}"]

    def _foreign(self, gguf_name: str) -> ValueError:
        return ValueError(f"GGUF tensor {gguf_name!r} is not part of a {self.arch!r} model "
                          f"as pkv runs it")

    def _weight_tensors(self) -> list[Any]:
        return [t for t in self.reader.tensors if t.name not in CONFIG_TENSORS]

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_specs())

    def tensor_specs(self) -> list[tuple[str, tuple[int, ...]]]:
        """(Hugging Face name, shape) of every tensor, in the order `tensors` yields them."""
        specs = []
        for t in self._weight_tensors():
            names, shape = self.hf_names(t.name), self.hf_shape(t.name)
            per_name = shape[1:] if len(names) > 1 else shape
            specs += [(name, per_name) for name in names]
        return specs

    def read(self, gguf_name: str) -> np.ndarray:
        """A tensor dequantized to float32, in PyTorch's shape, as stored (no unpermuting)."""
        from gguf import GGMLQuantizationType, quants

        t = self.names[gguf_name]
        type_name = GGMLQuantizationType(t.tensor_type).name
        if type_name not in _SUPPORTED_TYPES:
            raise ValueError(f"GGUF tensor {t.name} has type {type_name}, which pkv cannot "
                             f"read ({', '.join(_SUPPORTED_TYPES)})")
        data = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        return data.reshape(self.hf_shape(gguf_name))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (Hugging Face name, float32 tensor) for every weight in the file."""
        cfg = self.hf_config()
        for t in self._weight_tensors():
            data = self.read(t.name)
            if self.spec.permuted_qk and t.name.endswith(("attn_q.weight", "attn_q.bias")):
                data = _unpermute(data, cfg["num_attention_heads"])
            elif self.spec.permuted_qk and t.name.endswith(("attn_k.weight", "attn_k.bias")):
                data = _unpermute(data, cfg["num_key_value_heads"])
            if self.spec.norm_offset and t.name.endswith("norm.weight"):
                data = data - np.float32(self.spec.norm_offset)
            names = self.hf_names(t.name)
            parts = list(data) if len(names) > 1 else [data]
            for name, part in zip(names, parts):
                part = np.ascontiguousarray(part)
                if not part.flags.writeable:  # F32 tensors are views of the read-only file map
                    part = part.copy()
                yield name, torch.from_numpy(part)

    def tokenizer(self) -> Tokenizer:
        """The tokenizer from tokenizer.* metadata (plugins/weights/gguf_tokenizer.py)."""
        return gguf_tokenizer(self.field)


class GGUFLoader(WeightLoader):
    """Reads .gguf files; weights are dequantized to the compute dtype while loading."""

    name = "gguf"

    def open(self, path: Path) -> ModelSource:
        """The converted copy from the cache (core/model_loader/weight_cache.py) if there is one;
        else the GGUF itself, converted into the cache as its weights load."""
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
        config = ModelConfig.from_hf_dict(hf_config)  # config errors before the tokenizer
        tokenizer = gguf_file.tokenizer()
        specs = gguf_file.tensor_specs()

        def write_metadata(out: Path) -> None:
            (out / "config.json").write_text(json.dumps(hf_config, indent=2))
            write_tokenizer(out, tokenizer)

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            return convert_while_loading(gguf_file.tensors(), specs, folder, write_metadata)

        return ModelSource(path=path, name=path.stem, config=config, tokenizer=tokenizer,
                           num_tensors=len(specs), weights=weights, hf_config=hf_config,
                           quantization="gguf")
