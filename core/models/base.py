"""What every family shares: the decoder stack (embedding -> layers -> final norm), the LM
head, and loading checkpoint tensors (Hugging Face names) into place.

A family subclasses `CausalLM` and says how its layers are built (`make_layer`) and, where
it differs, how its checkpoint names map onto the modules (`checkpoint_tensors`) and what
happens to the logits (`process_logits`).

Layers pass the residual stream beside each sub-layer's output, so that the next norm can
add the two in one fused kernel:

    layer(h, residual) -> (h', residual')     with x = h + residual the true hidden state
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pkv.core.distributed.parallel import ShardPlan, single_rank_plan
from pkv.core.layers.attention import tp_split
from pkv.core.layers.attention_backend import AttentionBackend, AttentionMetadata
from pkv.core.layers.embedding import VocabEmbedding
from pkv.core.layers.ggml_linear import GGMLLinearMethod, sixteen_bit_blocks, use_ggml
from pkv.core.layers.ggml_tensor import GGMLTensor
from pkv.core.layers.linear import (Linear, LinearMethod, UnquantizedLinearMethod, as_tensor,
                                    check_shape, take)
from pkv.core.layers.moe import SparseMoE
from pkv.core.layers.norm import RMSNorm, SplitRMSNorm
from pkv.core.layers.rotary import RotaryEmbedding
from pkv.core.models.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]

# checkpoint module name -> (fused module name, shard index)
STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_UNSTACKED = {value: key for key, value in STACKED.items()}


@dataclass(frozen=True)
class BuildContext:
    """What building a layer needs besides the config."""

    backend: AttentionBackend
    method: LinearMethod | None
    plan: ShardPlan
    max_len: int


class DecoderModel(nn.Module):
    """embed -> N layers -> final norm. `rotary_emb` is the RoPE most layers use."""

    fused: Any = None  # the whole stack in C++ (core/worker/fused_decoder.py), set by `use_kernels`

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module], norm: RMSNorm,
                 rotary_emb: RotaryEmbedding | None, plan: ShardPlan,
                 embed_scale: float | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.hidden_size, plan)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary_emb = rotary_emb
        self.embed_scale = embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states. A pipeline stage's layers only (see `keep_stage`): from
        the previous stage's (hidden, residual) where given, and, but on the last stage (the
        one with the final norm), to this stage's."""
        residual: torch.Tensor | None = None
        if intermediate is not None:
            h, residual = intermediate
        else:
            h = self.embed_tokens(input_ids)  # [T, hidden]
            if self.embed_scale is not None:
                # transformers rounds the factor to the compute dtype first (Gemma)
                h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        last = self.norm is not None
        if self.fused is not None:
            groups = meta.groups or (meta,)
            h, residual = self.fused.forward_stage(
                h, residual, positions, kv_caches, [g.slot_mapping for g in groups],
                [g.block_tables for g in groups], list(meta.layer_groups), meta.seq_ids,
                meta.kv_lens, last)
            return h if last else (h, residual)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            h, residual = layer(h, residual, positions, kv_cache, meta.for_layer(i))
        if not last:
            return h, residual
        return self.norm.add_forward(h, residual)[0]


class CausalLM(nn.Module):
    """Decoder plus LM head; `forward` returns hidden states, `compute_logits` the logits.

    `method` decides how the decoder's linear layers store weights (float, AWQ, FP8); the
    embedding and the LM head stay in the compute dtype. `plan` says which slice of every
    split dimension this rank holds (everything, without tensor parallelism).
    """

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_len: int,
                 method: LinearMethod | None = None, plan: ShardPlan | None = None) -> None:
        super().__init__()
        self.config = cfg
        # A GGUF's blocks stay blocks where its linears do (else every tensor is dequantized).
        self.keeps_blocks = isinstance(method, GGMLLinearMethod)
        # The activations of a GGUF's LM head, kept in its blocks: those of the other linears.
        self.head_activation_bits = method.activation_bits if self.keeps_blocks else 32
        self.plan = plan or single_rank_plan(cfg)
        ctx = BuildContext(backend, method, self.plan, max_len)
        self.model = self.make_decoder(cfg, ctx)
        self.lm_head = Linear(cfg.hidden_size, [self.plan.vocab[1]], False,
                              split=tp_split(self.plan, "column", self.plan.vocab))
        self._logits_buffer: torch.Tensor | None = None  # see _lm_head
        self.stage_layers: range | None = None  # a pipeline stage's layers (keep_stage)
        self.tie_weights()

    # --- what a family says -----------------------------------------------------------

    def make_decoder(self, cfg: ModelConfig, ctx: BuildContext) -> DecoderModel:
        raise NotImplementedError

    def checkpoint_tensors(self, name: str, tensor: Any) -> Iterable[tuple[str, Any]]:
        """The checkpoint tensor `name` under the names this model loads (default: as is)."""
        yield name, tensor

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Final scaling or soft-capping of the logits (default: none)."""
        return logits

    # --- shared -------------------------------------------------------------------------

    def tie_weights(self) -> None:
        """Share the embedding with the LM head where the config says so (again after
        `to_empty`, which unties)."""
        if (self.config.tie_word_embeddings and self.lm_head is not None
                and self.model.embed_tokens is not None):
            self.lm_head.weight = self.model.embed_tokens.weight

    def keep_stage(self, layers: range, first: bool, last: bool) -> None:
        """Keep what one pipeline stage holds (on the meta device, before anything is
        allocated): `layers` of the decoder; the embedding and the LM head on the first
        stage (the driver computes the logits: a tied head is not held twice), the final
        norm on the last."""
        inner = self.model
        self.stage_layers = layers
        inner.layers = nn.ModuleList(list(inner.layers)[layers.start:layers.stop])
        if not first:
            inner.embed_tokens = None
            self.lm_head = None
        if not last:
            inner.norm = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def use_kernels(self, ops: Any, fused: Any = None) -> None:
        """Compute norms, RoPE, the MLP activation (csrc/layer_ops_cpu.cpp) and float32
        linears (csrc/gemv_cpu.cpp) with `ops` (float32 on CPU only), and the whole decoder
        stack with `fused` where given (see core/worker/fused_decoder.py); None goes back to
        torch."""
        from pkv.core.layers.mlp import GatedMLP
        from pkv.core.layers.moe import SparseMoE

        for module in self.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding, GatedMLP, SparseMoE)):
                module.kernel = ops
            elif isinstance(module, Linear) and isinstance(module.method, UnquantizedLinearMethod):
                module.kernel = ops
        self.model.fused = fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._lm_head(hidden)  # [num_sampled, this rank's vocab]
        logits = self.plan.tp.all_gather_last_dim(logits, self.plan.vocab_sizes)
        return self.process_logits(logits)

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head; a float32 one on the CPU kernels writes into one buffer that every
        step reuses. The logits are the largest tensor a step makes (SmolLM2 at 256 rows:
        50 MB), and a fresh one of more than 32 MB is a new mmap whose first touch
        page-faults (~14 ms of a ~400 ms step). A step's logits are sampled before the next
        step computes any. Other heads (int8, quantized, LoRA) run as they are."""
        head = self.lm_head
        if (head.kernel is None or not isinstance(head.method, UnquantizedLinearMethod)
                or hidden.dtype != torch.float32 or hidden.dim() != 2 or head.lora is not None):
            return head(hidden)
        rows = hidden.shape[0]
        if self._logits_buffer is None or self._logits_buffer.shape[0] < rows:
            self._logits_buffer = torch.empty(rows, head.weight.shape[0])
        return head.kernel.f32_linear(hidden, head.weight, head.bias, self._logits_buffer[:rows])

    def reset_buffers(self) -> None:
        """Recompute derived buffers (RoPE tables) after `to_empty`."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset()

    def _expected_tensors(self) -> dict[tuple[str, str, int | None], str]:
        """(module, parameter, shard) -> the checkpoint name that must fill it."""
        expected = {}
        moe = [path for path, m in self.named_modules() if isinstance(m, SparseMoE)]
        for path, module in self.named_modules():
            if path == "lm_head" and self.config.tie_word_embeddings:
                continue
            if any(path == p or path.startswith(p + ".") for p in moe):
                continue
            if isinstance(module, Linear):
                shards = range(len(module.out_sizes)) if len(module.out_sizes) > 1 else [None]
                for leaf in module.layouts:
                    for shard in shards:
                        expected[(path, leaf, shard)] = checkpoint_name(path, leaf, shard)
            elif not isinstance(module, CausalLM):
                for leaf, _ in module.named_parameters(recurse=False):
                    expected[(path, leaf, None)] = f"{path}.{leaf}"
        return expected

    def _renamed(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        headless = self.config.headless
        for name, tensor in weights:
            if headless and not name.startswith("model."):
                name = f"model.{name}"  # saved as the bare decoder (`Qwen3Model`)
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for renamed, part in self.checkpoint_tensors(name, tensor):
                renamed = self._stage_name(renamed)
                if renamed is not None:
                    yield renamed, part

    def _stage_name(self, name: str) -> str | None:
        """A checkpoint name as this pipeline stage holds it (its layers numbered from 0), or
        None for what another stage holds."""
        layers = self.stage_layers
        if layers is None:
            return name
        if name.startswith("model.layers."):
            index, _, rest = name[len("model.layers."):].partition(".")
            i = int(index)
            return f"model.layers.{i - layers.start}.{rest}" if i in layers else None
        if name.startswith(("model.embed_tokens.", "lm_head.")):
            return name if self.lm_head is not None else None
        if name.startswith("model.norm."):
            return name if self.model.norm is not None else None
        return name

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into place; all must be set. Then let
        each linear layer convert what it loaded."""
        modules = dict(self.named_modules())
        moe = {p: m for p, m in modules.items() if isinstance(m, SparseMoE)}
        missing = self._expected_tensors()
        for name, tensor in self._renamed(weights):
            if isinstance(tensor, GGMLTensor) and not self.keeps_blocks:
                tensor = as_tensor(tensor)  # (experts too: float32 or a GPU asked for floats)
            owner = _moe_owner(name, moe)
            if owner is not None:
                moe[owner].load_checkpoint(name[len(owner) + 1:], tensor, name)
                continue
            path, _, leaf = name.rpartition(".")
            base, _, part = path.rpartition(".")
            fused, shard = STACKED.get(part, (part, None))
            path = f"{base}.{fused}" if base else fused
            module = modules.get(path)
            if (self.keeps_blocks and leaf == "weight"
                  and (module is self.lm_head or isinstance(module, VocabEmbedding))):
                tensor = sixteen_bit_blocks(tensor)
            if isinstance(module, Linear):
                if isinstance(tensor, GGMLTensor) and isinstance(module.method,
                                                                 UnquantizedLinearMethod):
                    use_ggml(module, self.head_activation_bits)  # a GGUF's LM head, in its blocks
                module.load(leaf, tensor, shard, name)
            elif isinstance(module, (VocabEmbedding, SplitRMSNorm)) and leaf == "weight":
                module.load(tensor, name)  # (each takes its rank's slice)
            elif module is not None and isinstance(module._parameters.get(leaf), nn.Parameter):
                param, tensor = module._parameters[leaf], as_tensor(tensor)
                check_shape(param, tensor, name)
                param.copy_(tensor)
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            missing.pop((path, leaf, shard), None)
        names = sorted(missing.values())
        names += [f"{p}.experts {m}" for p, module in moe.items() for m in module.missing()]
        if names:
            raise ValueError(f"checkpoint lacks {len(names)} tensor(s), e.g. {names[:3]}")
        table = self.model.embed_tokens.table if self.model.embed_tokens is not None else None
        if self.config.tie_word_embeddings and table is not None:
            use_ggml(self.lm_head, self.head_activation_bits)
            self.lm_head.parts = [table]  # this rank's rows already
        for module in self.modules():
            if isinstance(module, Linear):
                module.method.process_weights_after_loading(module)


def add_norm(norm: RMSNorm, h: torch.Tensor,
             residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Into a pre-normed sub-layer: (norm(residual + h), residual + h); the first layer's
    residual is h itself (None before it)."""
    if residual is None:
        return norm(h), h
    return norm.add_forward(h, residual)


def _moe_owner(name: str, moe: dict[str, SparseMoE]) -> str | None:
    if not moe:
        return None
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in moe:
            return prefix
    return None


def split_fused(name: str, tensor: Any, parts: list[tuple[str, int]],
                dim: int = 0) -> Iterator[tuple[str, Any]]:
    """A checkpoint's fused projection (`qkv_proj.weight`) as its parts' names and rows, e.g.
    [("q_proj", 2048), ("k_proj", 512), ("v_proj", 512)]; rows are read lazily. `dim` is
    the output axis (1 for AWQ's packed tensors)."""
    path, _, leaf = name.rpartition(".")
    base, _, _ = path.rpartition(".")
    start = 0
    for part, rows in parts:
        yield f"{base}.{part}.{leaf}", take(tensor, dim, start, rows)
        start += rows


def checkpoint_name(path: str, leaf: str, shard: int | None) -> str:
    if shard is not None:
        base, _, fused = path.rpartition(".")
        path = f"{base}.{_UNSTACKED[(fused, shard)]}"
    return f"{path}.{leaf}"
