"""EngineConfig: every engine setting in one place, validated at construction.

`pkv serve` (cli/serve.py) names each field as an option of the same name (dashes for
underscores), with its own help text.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pkv.core.config.speculative import SpeculativeConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
TASKS = ("auto", "generate", "embed", "classify", "score")
_LM_HEAD_QUANTIZATIONS = ("auto", "none", "int8")
_AWQ_ACTIVATIONS = ("float32", "int16", "int8")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# `fp8` is vLLM's spelling of fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8")
SCALED_KV_CACHE_DTYPES = ("int8", "fp8_e4m3", "fp8")  # rows of codes and a scale
_SIZE_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2,
               "G": 1000**3, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3,
               "TIB": 1024**4}


def parse_memory_size(value: int | float | str, name: str = "kv_cache_memory") -> int:
    """Parse bytes given as a number or a string like "512MiB", "2GB", "1.5GiB"; `name` is
    the option that errors name."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{name} must be > 0 bytes, got {value}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(
            f"{name} must be bytes or a size like '512MiB' or '2GB', got {value!r}")
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"{name} must be > 0 bytes, got {value!r}")
    return size


# The option types EngineConfig's annotations name, as Python types (bool is not an int here).
_KINDS: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "float": (int, float),
                                      "bool": (bool,), "None": (type(None),), "dict": (dict,)}
_KIND_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
               "None": "unset", "dict": "a mapping"}


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class EngineConfig:
    """All engine settings. Unknown keys are errors (see `from_dict`)."""

    model: str | None = _opt(None, "Hugging Face folder, .gguf file or Hub id (ORG/NAME); "
                             "default: bundled SmolLM2.")
    revision: str | None = _opt(None, "Branch, tag or commit of a Hub id (default: main).")
    gguf_file: str | None = _opt(None, "The .gguf file to load from a Hub id or folder.")
    task: str = _opt(
        "auto", "What the model serves: auto (from the checkpoint), generate, embed (an "
        "embedding model: /v1/embeddings) or classify / score (a cross-encoder: /v1/rerank, "
        "/score).")
    dtype: str = _opt("auto", "Compute dtype: auto, float32, bfloat16, float16 "
                      "(auto: float32 on CPU, a 16-bit checkpoint's weights kept in 16 bits "
                      "and a GGUF's in its blocks; the checkpoint's dtype on GPU). float32 "
                      "widens every weight.")
    device: str = _opt("auto", "Device: auto, cpu or cuda.")
    block_size: int = _opt(16, "Tokens per KV cache block.")
    kv_cache_dtype: str = _opt(
        "auto", "KV cache storage: auto (the compute dtype), float32, bfloat16, float16, int8 "
        "or fp8_e4m3 (alias fp8): 8-bit rows with one float32 scale per token and KV head, "
        "~3.8x the tokens of float32 in the same memory at head size 64.")
    kv_cache_memory: int | str | None = _opt(
        None, "Bytes for the KV cache pool (e.g. 512MiB); overrides memory_utilization.")
    memory_utilization: float = _opt(
        0.9, "Fraction of device memory the process may use (weights + KV cache).")
    max_num_seqs: int = _opt(256, "Most sequences running in one step.")
    max_num_batched_tokens: int | None = _opt(
        None, "Most tokens in one step (default: 2048 or max_model_len if smaller).")
    max_model_len: int | None = _opt(None, "Longest prompt + output (default: the model's).")
    seed: int = _opt(0, "Seed for requests that do not set their own.")
    generation_config: str = _opt(
        "auto", "Sampling defaults for what a request leaves unset: auto (the model's "
        "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty) or "
        "none (OpenAI's).")
    enable_prefix_caching: bool = _opt(True, "Reuse KV blocks of identical prompt prefixes.")
    kv_offload_dir: str | None = _opt(
        None, "Folder for a disk tier of the prefix cache: full blocks evicted from the pool "
        "are saved there and read back on a later hit, also after a restart (one server "
        "per folder).")
    kv_offload_size: int | str = _opt(
        "4GiB", "Most bytes kv_offload_dir may hold (e.g. 20GiB); least recently used "
        "blocks are deleted past it.")
    tensor_parallel_size: int = _opt(1, "Devices to split the model over.")
    pipeline_parallel_size: int = _opt(
        1, "Pipeline stages: each process holds a contiguous run of layers (and their KV), "
        "hidden states pass from stage to stage.")
    pp_layer_partition: str | None = _opt(
        None, "Layers per pipeline stage, comma-separated (e.g. 10,12); default: as even as "
        "the stages' bytes allow.")
    attention_backend: str = _opt("auto", "Attention backend: auto or a name from "
                                  "`pkv plugins` (cpu, torch, ...).")
    quantization: str | None = _opt(
        "auto", "Weight format: auto (what the checkpoint says), none, awq, fp8, gguf "
        "(fp8 on a float checkpoint quantizes it while loading).")
    lm_head_quantization: str = _opt(
        "auto", "LM head storage: auto (int8 on CPU when the decoder is 4-bit, else the "
        "compute dtype), none, int8 (weight-only, one scale per token; CPU).")
    awq_activations: str = _opt(
        "float32", "Activations of 4-bit linears (AWQ, a GGUF's Q4_0/Q4_1) on CPU in the GEMV "
        "(up to 12-16 rows): float32 (exactly the dequantized weights' product), int16 "
        "(quantized per weight group, integer dot products) or int8 (quantized per 32 inputs, "
        "byte dot products: the fastest decode on AVX2, llama.cpp's Q8 activations); int8 also "
        "takes a GGUF's K-quants (Q4_K, Q5_K, Q6_K, kept in their blocks) through byte dot "
        "products at up to 64 rows, x quantized per 256 inputs (llama.cpp's Q8_K); int16 and "
        "int8 on the AVX2 and AVX-512 kernels).")
    guided_decoding_backend: str = _opt("auto", "Guided decoding backend: auto (per constraint "
                                        "kind), outlines, xgrammar (see `pkv plugins`).")
    structured_outputs_timeout: float = _opt(30.0, "Seconds a constraint may take to compile.")
    enable_lora: bool = _opt(False, "Serve LoRA adapters (per request) on the base model.")
    max_loras: int = _opt(4, "Adapters resident at once (preallocated slots; LRU-evicted).")
    max_lora_rank: int = _opt(16, "Highest adapter rank the slots hold.")
    speculative_config: dict[str, Any] | str | None = _opt(
        None, "Speculative decoding as JSON, vLLM's keys: {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4} or {\"model\": DRAFT, \"num_speculative_tokens\": 4}; "
        "also prompt_lookup_min/max, disable_by_batch_size.")

    def __post_init__(self) -> None:
        self._check_types()
        if not -2**63 <= self.seed < 2**64:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size}")
        if self.generation_config not in ("auto", "none"):
            raise ValueError(f"generation_config must be auto or none, got "
                             f"{self.generation_config!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_memory_size(self.kv_cache_memory)
        self.kv_offload_size = parse_memory_size(self.kv_offload_size, "kv_offload_size")
        if self.kv_offload_dir is not None:
            self._check_kv_offload()
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(
                f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got "
                             f"{self.tensor_parallel_size!r}")
        if not isinstance(self.attention_backend, str) or not self.attention_backend:
            raise ValueError("attention_backend must be 'auto' or a backend name "
                             "(see `pkv plugins`)")
        if self.quantization is not None and (not isinstance(self.quantization, str)
                                              or not self.quantization):
            raise ValueError("quantization must be auto, none or a method name "
                             f"(see `pkv plugins`), got {self.quantization!r}")
        if self.lm_head_quantization not in _LM_HEAD_QUANTIZATIONS:
            raise ValueError("lm_head_quantization must be one of "
                             f"{', '.join(_LM_HEAD_QUANTIZATIONS)}, got "
                             f"{self.lm_head_quantization!r}")
        if self.awq_activations not in _AWQ_ACTIVATIONS:
            raise ValueError(f"awq_activations must be one of {', '.join(_AWQ_ACTIVATIONS)}, "
                             f"got {self.awq_activations!r}")
        if not 0 < self.structured_outputs_timeout < float("inf"):
            raise ValueError("structured_outputs_timeout must be > 0 seconds, got "
                             f"{self.structured_outputs_timeout}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not isinstance(self.max_loras, int) or not 1 <= self.max_loras <= 256:
            raise ValueError(f"max_loras must be an integer in [1, 256], got {self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or not 1 <= self.max_lora_rank <= 512:
            raise ValueError("max_lora_rank must be an integer in [1, 512], got "
                             f"{self.max_lora_rank!r}")
        self._check_pipeline()
        if self.speculative_config is not None:
            # Parsed once here (one-line errors before anything loads), kept as a plain dict
            # so the config still travels as one (tensor-parallel workers, YAML).
            self.speculative_config = asdict(SpeculativeConfig.parse(self.speculative_config))

    @property
    def world_size(self) -> int:
        """Processes one engine runs on: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_pipeline(self) -> None:
        pp = self.pipeline_parallel_size
        if not isinstance(pp, int) or pp < 1:
            raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {pp!r}")
        if self.pp_layer_partition is not None and pp == 1:
            raise ValueError("pp_layer_partition needs pipeline_parallel_size > 1")

    def _check_kv_offload(self) -> None:
        if not isinstance(self.kv_offload_dir, str) or not self.kv_offload_dir:
            raise ValueError(f"kv_offload_dir must be a folder path, got {self.kv_offload_dir!r}")
        if Path(self.kv_offload_dir).expanduser().is_file():
            raise ValueError(f"kv_offload_dir {self.kv_offload_dir!r} is a file; name a folder "
                             "(made if missing)")
        if not self.enable_prefix_caching:
            raise ValueError("kv_offload_dir needs enable_prefix_caching (it extends the prefix "
                             "cache)")

    def token_budget(self, max_model_len: int, encoder: bool = False) -> int:
        """Most tokens one step computes: max_num_batched_tokens, or by default 2048 (at
        most max_model_len, at least max_num_seqs; an encoder, which keeps no KV, 2048
        whatever its max_model_len: a step's many short prompts run as one batch)."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        if encoder:
            return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
        return min(DEFAULT_MAX_NUM_BATCHED_TOKENS, max(max_model_len, self.max_num_seqs))

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed `speculative_config`, or None when off."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    def _check_types(self) -> None:
        """ValueError naming the first option of the wrong type (YAML reads `1e3` as a
        string, say), before any check compares it."""
        for f in fields(self):
            value = getattr(self, f.name)
            kinds = [part.strip().split("[")[0] for part in str(f.type).split("|")]
            if isinstance(value, os.PathLike) and "str" in kinds:  # a Path names a file too
                value = os.fspath(value)
                setattr(self, f.name, value)
            allowed = tuple(t for k in kinds for t in _KINDS.get(k, ()))
            if (isinstance(value, bool) and "bool" not in kinds) or not isinstance(value, allowed):
                wanted = " or ".join(_KIND_NAMES.get(k, k) for k in kinds)
                raise ValueError(f"{f.name} must be {wanted}, got {value!r}")

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> EngineConfig:
        """Build from a mapping (YAML, kwargs); unknown keys are an error, never dropped."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        hints = [f"{name}: {VLLM_HINTS[name]}" for name in unknown if name in VLLM_HINTS]
        if hints:
            raise ValueError(f"unknown engine option(s): {'; '.join(hints)}")
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**options)


# vLLM options a vLLM user passes, and what pkv has instead.
VLLM_HINTS = {
    "gpu_memory_utilization": "pkv calls it memory_utilization (it applies on CPU too)",
    "trust_remote_code": "pkv runs no code from a checkpoint; leave it out",
    "enforce_eager": "pkv captures no graphs to turn off; leave it out",
}
