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
- Phi-3's LongRoPE factors are tensors (`rope_factors_long/short`): they go into the config;
- BERT (`bert`) keeps the encoder's own names (`encoder.layer.N.attention.self.query`,
  `embeddings.*`), and an embedding model's `{arch}.pooling_type` becomes `pooling_mode`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from pkv.core.layers.ggml_linear import GGMLLinearMethod
from pkv.core.layers.ggml_tensor import FORMATS, GGMLTensor
from pkv.core.layers.linear import LinearMethod
from pkv.core.model_loader.loader import ModelSource
from pkv.core.model_loader.quantization import WeightLoader
from pkv.core.models.config import ModelConfig
from pkv.core.tokenizer.tokenizer import Tokenizer
from pkv.plugins.weights.gguf_archs import (ARCHS, CONFIG_TENSORS, EXPERT_PARTS, LAYER_NAMES,
                                            decimal, pooling_fields)
from pkv.plugins.weights.gguf_header import GGUFHeader, TensorInfo, read_header
from pkv.plugins.weights.gguf_tokenizer import gguf_tokenizer

Weight = torch.Tensor | GGMLTensor
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Hugging Face's row order of a q/k tensor (float values, a bias, or rows of blocks)."""
    rows, rest = w.shape[0], tuple(w.shape[1:])
    return (w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2)
            .reshape(rows, *rest).contiguous())


def _unpermute_weight(w: Weight, n_head: int) -> Weight:
    if isinstance(w, GGMLTensor):  # whole rows move: the blocks stay as they are
        return GGMLTensor(_unpermute(w.data, n_head), w.qtype, w.cols)
    return _unpermute(w, n_head)


def _checked_header(path: Path) -> GGUFHeader:
    """The header of the GGUF file at `path`, mapped copy-on-write (nothing is read until
    used), with every tensor's type and extent checked first, so that a bad file fails in one
    line that names the tensor."""
    try:
        header = read_header(path)
        for tensor in header.tensors:
            _check_tensor(tensor, len(header.data))
        _check_disjoint(header.tensors)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from None
    return header


def _check_disjoint(tensors: list[TensorInfo]) -> None:
    """No tensor's bytes run into the next one's: a type id or shape changed by corruption
    would read its neighbour's bytes as its own (and quietly make every logit NaN)."""
    ordered = sorted(tensors, key=lambda t: t.start)
    for tensor, after in zip(ordered, ordered[1:]):
        if tensor.start + _tensor_bytes(tensor) > after.start:
            raise ValueError(f"GGUF tensor {tensor.name} ({_tensor_bytes(tensor)} bytes at "
                             f"offset {tensor.start}) runs into {after.name} at offset "
                             f"{after.start}: its type or shape is corrupt")


def _check_tensor(tensor: TensorInfo, file_size: int) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    name, type_id, dims = tensor.name, tensor.type_id, tensor.dims
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"GGUF tensor {name}: unknown tensor type id {type_id}") from None
    if type_id not in FORMATS:
        known = ", ".join(f.name for f in FORMATS.values())
        raise ValueError(f"GGUF tensor {name} is {qtype.name}, which pkv does not run "
                         f"(it runs {known})")
    block, size = GGML_QUANT_SIZES[qtype]
    row = dims[0] if dims else 1
    if row % block:
        raise ValueError(f"GGUF tensor {name}: rows of {row} values are not whole "
                         f"{qtype.name} blocks of {block}")
    n_bytes = _tensor_bytes(tensor)
    if tensor.start + n_bytes > file_size:
        raise ValueError(f"GGUF tensor {name} ({qtype.name} {list(reversed(dims))}) "
                         f"needs {n_bytes} bytes up to offset {tensor.start + n_bytes}, past "
                         f"the file's end ({file_size} bytes): the file is truncated or corrupt")


def _tensor_bytes(tensor: TensorInfo) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.type_id)]
    return math.prod(int(d) for d in tensor.dims) // block * size  # (int64 would wrap)


class GGUFFile:
    """An opened GGUF file; fields are read lazily, tensors mapped from it on iteration."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.header = _checked_header(path)
        parts = self.field("split.count")
        if isinstance(parts, int) and parts > 1:
            raise ValueError(f"{path.name} is one of {parts} parts of a split GGUF; pkv reads "
                             "a whole file (join the parts with llama.cpp's `llama-gguf-split "
                             "--merge FIRST-PART OUT.gguf`)")
        self.arch = str(self.field("general.architecture"))
        if self.arch not in ARCHS:
            raise ValueError(f"GGUF architecture {self.arch!r} is not supported; pkv runs "
                             f"{', '.join(ARCHS)}")
        self.spec = ARCHS[self.arch]
        self.names = {t.name: t for t in self.header.tensors}
        self._config: dict[str, Any] | None = None

    def field(self, key: str, default: Any = None) -> Any:
        value = self.header.fields.get(key)
        return default if value is None else decimal(value)

    def key(self, name: str, default: Any = None) -> Any:
        """The architecture's field `{arch}.{name}`."""
        return self.field(f"{self.arch}.{name}", default)

    def hf_config(self) -> dict[str, Any]:
        """The model's config.json equivalent."""
        if self._config is None:
            cfg = self._common_config()
            if self.spec.fields is not None:
                try:
                    self.spec.fields(self, cfg)
                except (TypeError, ArithmeticError, IndexError, KeyError) as exc:
                    # a field of the wrong kind, or one of two that go together left out
                    raise ValueError(f"{self.path.name}: its {self.arch!r} metadata cannot "
                                     f"be read ({type(exc).__name__}: {exc})") from None
            pooling_fields(self, cfg)
            self._config = cfg
        return self._config

    def needed(self, name: str) -> int:
        """The architecture's integer field `{arch}.{name}`, which a model cannot lack."""
        value = self.key(name)
        if value is None:
            raise ValueError(f"{self.path.name} lacks {self.arch}.{name}: not a complete "
                             f"{self.arch!r} GGUF")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{self.path.name}: {self.arch}.{name} is {value!r}, not one "
                             "number (pkv reads one value for every layer)")
        return int(value)

    def positive(self, name: str, default: Any = None) -> int:
        """A count that must be above zero (`default` where the file may leave it out)."""
        value = default if default is not None and self.key(name) is None else self.needed(name)
        if value < 1:
            raise ValueError(f"{self.path.name}: {self.arch}.{name} is {value}; not a "
                             "readable GGUF")
        return value

    def _common_config(self) -> dict[str, Any]:
        heads = self.positive("attention.head_count")
        hidden = self.positive("embedding_length")
        head_dim = self.positive("attention.key_length", hidden // heads)
        kv_heads = self.positive("attention.head_count_kv", heads)
        context = self.positive("context_length", 2048)
        if "token_embd.weight" not in self.names:
            raise ValueError(f"{self.path.name} has no token_embd.weight: not a complete "
                             f"{self.arch!r} GGUF")
        cfg: dict[str, Any] = {
            "architectures": [self.spec.hf_arch],
            "vocab_size": self.hf_shape("token_embd.weight")[0],
            "hidden_size": hidden,
            "intermediate_size": self.needed("feed_forward_length"),
            "num_hidden_layers": self.positive("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": float(self.key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_parameters": self.rope_parameters(),
            "max_position_embeddings": context,
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

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape in PyTorch order, by GGUF name."""
        return {name: self.hf_shape(name) for name in self.names}

    def hf_shape(self, gguf_name: str) -> tuple[int, ...]:
        """Shape of a GGUF tensor in PyTorch order (GGUF lists dims fastest first)."""
        return tuple(reversed(self.names[gguf_name].dims))

    def hf_names(self, gguf_name: str) -> list[str]:
        """The Hugging Face tensor(s) a GGUF tensor holds: one per expert for stacked ones."""
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
        if match is None:
            base, _, kind = gguf_name.rpartition(".")
            if base not in self.spec.global_names:
                raise self._foreign(gguf_name)
            return [f"{self.spec.global_names[base]}.{kind}"]
        layer, part, kind = match.groups()
        prefix = f"{self.spec.layer_prefix}.{layer}"
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
        return [t for t in self.header.tensors if t.name not in CONFIG_TENSORS]

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

    def read(self, gguf_name: str) -> Weight:
        """A tensor in PyTorch's shape, as stored (no unpermuting): a 2-D one in ggml blocks
        (quantized or 16-bit: a GGMLTensor mapped from the file; stacked experts [E, rows,
        bytes]), or float32 (F32, every 1-D tensor, and a 16-bit one whose rows are not whole
        32-value blocks, as a 312-wide TinyBERT's)."""
        t = self.names[gguf_name]
        shape = self.hf_shape(gguf_name)
        data = torch.from_numpy(self.header.tensor_bytes(t.start, _tensor_bytes(t)))
        odd_16_bit = FORMATS[t.type_id].name in _FLOAT_DTYPES and shape[-1] % 32 != 0
        if t.type_id == 0 or len(shape) == 1 or odd_16_bit:  # float32 values
            return _float(data, t.type_id, shape)
        return _blocks(data, t.type_id, shape)

    def tensors(self) -> Iterator[tuple[str, Weight]]:
        """Yield (Hugging Face name, weight) for every weight in the file."""
        cfg = self.hf_config()
        for t in self._weight_tensors():
            data = self.read(t.name)
            if self.spec.permuted_qk and t.name.endswith(("attn_q.weight", "attn_q.bias")):
                data = _unpermute_weight(data, cfg["num_attention_heads"])
            elif self.spec.permuted_qk and t.name.endswith(("attn_k.weight", "attn_k.bias")):
                data = _unpermute_weight(data, cfg["num_key_value_heads"])
            if self.spec.norm_offset and t.name.endswith("norm.weight"):
                data = data - self.spec.norm_offset
            names = self.hf_names(t.name)
            if len(names) > 1:  # stacked experts: one tensor each
                yield from zip(names, _experts(data, len(names)))
            else:
                yield names[0], data

    def tokenizer(self) -> Tokenizer:
        """The tokenizer from tokenizer.* metadata (plugins/weights/gguf_tokenizer.py)."""
        return gguf_tokenizer(self.field)


def _float(data: torch.Tensor, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's bytes as float32 values."""
    name = FORMATS[qtype].name
    if name in _FLOAT_DTYPES:
        return data.view(_FLOAT_DTYPES[name]).float().reshape(shape)
    return GGMLTensor(data.reshape(1, -1), qtype, int(np.prod(shape))).dequantize().reshape(shape)


def _blocks(data: torch.Tensor, qtype: int, shape: tuple[int, ...]) -> GGMLTensor | torch.Tensor:
    """Rows of ggml blocks, [rows, bytes] (2-D) or [E, rows, bytes] (stacked experts, held as
    a uint8 tensor until split)."""
    fmt = FORMATS[qtype]
    row_bytes = shape[-1] // fmt.values * fmt.bytes
    if len(shape) == 2:
        return GGMLTensor(data.reshape(shape[0], row_bytes), qtype, shape[-1])
    return _Stacked(data.reshape(*shape[:-1], row_bytes), qtype, shape[-1])


class _Stacked(NamedTuple):
    """Experts' tensors [E, rows, bytes] in one ggml type."""

    data: torch.Tensor
    qtype: int
    cols: int


def _experts(data: Any, count: int) -> list[Weight]:
    if isinstance(data, _Stacked):
        return [GGMLTensor(data.data[e], data.qtype, data.cols) for e in range(count)]
    return list(data)


class GGUFLoader(WeightLoader):
    """Reads .gguf files. Their weights stay in the file's block formats, mapped from it
    (core/layers/ggml_linear.py); norms and biases are float32."""

    name = "gguf"

    def open(self, path: Path) -> ModelSource:
        gguf_file = GGUFFile(path)
        hf_config = gguf_file.hf_config()
        config = ModelConfig.from_hf_dict(hf_config)  # config errors before the tokenizer
        tokenizer = gguf_file.tokenizer()
        return ModelSource(path=path, name=path.stem, config=config, tokenizer=tokenizer,
                           num_tensors=gguf_file.num_tensors, weights=gguf_file.tensors,
                           hf_config=hf_config, quantization="gguf")

    def linear_method(self, source: ModelSource, device: torch.device) -> LinearMethod | None:
        if device.type != "cpu":
            return None  # GPUs take float weights: as_tensor dequantizes each
        return GGMLLinearMethod()
