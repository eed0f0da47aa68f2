"""What is decided about a model before its weights load, the same on every rank: its device,
dtype and context length, its attention backend and weight loader, the checks that the
settings fit it (tensor-parallel split, pooling task, pipeline partition), and each rank's
tensor-parallel group and pipeline stage."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from pkv.core.config.engine import SCALED_KV_CACHE_DTYPES, EngineConfig
from pkv.core.distributed.parallel import TPGroup, check_tp_size
from pkv.core.distributed.pipeline import (PipelineStage, object_group, partition_layers,
                                           stage_of)
from pkv.core.layers.attention_backend import AttentionBackend
from pkv.core.model_loader.loader import ModelSource, open_model
from pkv.core.model_loader.quantization import WeightLoader, resolve_weight_loader
from pkv.core.models.config import ModelConfig
from pkv.core.models.registry import family_of
from pkv.core.pooling.tasks import resolve_task
from pkv.core.registry import PluginRegistry, discover, select_attention_backend
from pkv.csrc import cpp_build

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, model: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU (bf16 matmul is many times slower without native bf16),
    the checkpoint's dtype on GPU."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(str(model.torch_dtype).removeprefix("torch."), torch.bfloat16)


def keeps_16_bit(config: EngineConfig, model: ModelConfig, device: torch.device) -> bool:
    """Whether a float16 / bfloat16 checkpoint keeps its weights in 16 bits on CPU: with
    `dtype=auto` (float32 computes, float32 accumulates) where the kernels build and every
    linear's inputs are whole 32-value blocks."""
    if config.dtype != "auto" or device.type != "cpu":
        return False
    if str(model.torch_dtype).removeprefix("torch.") not in ("bfloat16", "float16"):
        return False
    widths = (model.hidden_size, model.intermediate_size or 32,
              model.num_attention_heads * model.head_dim)
    return all(w % 32 == 0 for w in widths) and cpp_build.kernels_or_none() is not None


def resolve_max_model_len(config: EngineConfig, model_max: int) -> int:
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                         f"max_position_embeddings ({model_max})")
    return config.max_model_len


@dataclass
class ModelSetup:
    """Everything decided about the model before its weights load (same on every rank)."""

    source: ModelSource
    max_model_len: int
    device: torch.device
    backend: AttentionBackend
    loader: WeightLoader | None
    registry: PluginRegistry
    task: str = "generate"  # generate, embed or classify (see core/pooling/tasks.py)

    @classmethod
    def prepare(cls, config: EngineConfig) -> ModelSetup:
        """Open the model and pick its attention backend and weight loader; errors here
        come before any weights load."""
        registry = discover()
        source = open_model(config.model, registry, revision=config.revision,
                            gguf_file=config.gguf_file)
        device = resolve_device(config.device)
        backend = select_attention_backend(config.attention_backend, device.type, registry,
                                           config.kv_cache_dtype in SCALED_KV_CACHE_DTYPES)
        loader = resolve_weight_loader(config.quantization, source, registry)
        task = check_model(config, source)
        return cls(source, resolve_max_model_len(config, source.config.max_position_embeddings),
                   device, backend, loader, registry, task)


def check_model(config: EngineConfig, source: ModelSource) -> str:
    """What the model and the settings must agree on before any weights load (the split,
    the task, a pooling model's limits, the pipeline's partition); returns the task."""
    if config.tensor_parallel_size > 1:
        check_tp_size(source.config, config.tensor_parallel_size)
    task = resolve_task(config.task, source.config, source.folder)
    if task != "generate":
        check_pooling_config(config, task, source.config)
    if config.pipeline_parallel_size > 1:
        check_pipeline_model(config, source.config)
    return task


def check_pooling_config(config: EngineConfig, task: str, model: ModelConfig) -> None:
    """What an embedding or scoring model does not run with, each in one line (a decoder
    saved for embeddings runs split over ranks and stages and with adapters; an encoder
    does neither)."""
    encoder = not getattr(family_of(model.architecture), "keeps_kv", True)
    off = [(config.tensor_parallel_size > 1 and encoder, "tensor parallelism"),
           (config.enable_lora and encoder, "LoRA adapters"),
           (config.speculative_config is not None, "speculative decoding"),
           (config.kv_offload_dir is not None, "a KV disk tier"),
           (config.pipeline_parallel_size > 1 and encoder, "pipeline parallelism")]
    for on, what in off:
        if on:
            raise ValueError(f"task={task} (a pooling model) does not run with {what}")


def check_pipeline_model(config: EngineConfig, model: ModelConfig) -> None:
    """The pipeline's partition of this model parses and gives every stage a layer (a
    one-line error if not)."""
    pipeline_stage(config, model, 0)


def parallel_groups(config: EngineConfig, model: ModelConfig,
                    rank: int) -> tuple[TPGroup, PipelineStage]:
    """This world rank's tensor-parallel group and pipeline stage. With both, world rank
    r is member r % T of stage r // T, and each stage's members are a process group of
    their own (made here on every rank, in the same order, as torch.distributed needs)."""
    width = config.tensor_parallel_size
    if config.pipeline_parallel_size == 1:
        return TPGroup(rank, width), PipelineStage()
    stage, member = divmod(rank, width)
    tp = TPGroup()
    if width > 1:
        groups = [dist.new_group(list(range(s * width, (s + 1) * width)))
                  for s in range(config.pipeline_parallel_size)]
        tp = TPGroup(member, width, groups[stage])
    return tp, replace(pipeline_stage(config, model, stage, member), objects=object_group())


def pipeline_stage(config: EngineConfig, model: ModelConfig, stage: int,
                   member: int = 0) -> PipelineStage:
    """Stage `stage`'s layers: `pp_layer_partition`, or as even as the stages' weights allow
    (the first also holds the embedding and the LM head)."""
    table = model.vocab_size * model.hidden_size
    head = 0 if model.tie_word_embeddings else table
    layer = (model.num_parameters - table - head - model.hidden_size) / model.num_hidden_layers
    counts = partition_layers(model.num_hidden_layers, config.pipeline_parallel_size,
                              config.pp_layer_partition, layer, table + head)
    return stage_of(stage, counts, config.tensor_parallel_size, member)
