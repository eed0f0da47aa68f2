"""ModelRunner: owns the model and the KV cache; turns a SchedulerOutput into sampled tokens.

Per step it flattens the scheduled requests into one batch (input_batch.py), runs the model
once, computes logits only for the rows that sample, and samples them. Under pipeline
parallelism each rank's runner is a PipelineModelRunner (pipeline_runner.py).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from pkv.core.config.engine import EngineConfig
from pkv.core.distributed.parallel import ShardPlan, TPGroup
from pkv.core.distributed.pipeline import PipelineStage, Sent
from pkv.core.layers.ggml_linear import GGMLLinearMethod, ggml_storage
from pkv.core.layers.kv_format import kv_format
from pkv.core.layers.kv_groups import plan_kv_groups
from pkv.core.layers.linear import UnquantizedLinearMethod
from pkv.core.lora.adapter import LoRAWeight
from pkv.core.lora.layers import LoRABatch, attach_lora, lora_segments, merge_targets
from pkv.core.model_loader.loader import build_model
from pkv.core.model_loader.quantization import int8_lm_head
from pkv.core.pooling.pooler import Pooler
from pkv.core.pooling.tasks import build_pooler
from pkv.core.sample.prompt_logprobs import LogprobEntry
from pkv.core.sample.prompt_logprobs import entries as prompt_entries
from pkv.core.sample.rejection_sampler import RejectionSampler, VerifyOutput
from pkv.core.sample.sampler import Sampler, SamplingRow
from pkv.core.sample.sampling_params import SamplingParams
from pkv.core.sched.request import Request, record_failure
from pkv.core.sched.scheduler import SchedulerOutput
from pkv.core.worker.fused_decoder import build_fused_decoder
from pkv.core.worker.huge_pages import empty_on_huge_pages, move_weights_to_huge_pages
from pkv.core.worker.input_batch import (SeqChunk, flatten_batch, pool_spans, split_logits,
                                         step_chunks, token_types)
from pkv.core.worker.kv_parts import KVParts, KVTransfer, KVWork
from pkv.core.worker.kv_pool_size import num_kv_blocks
from pkv.core.worker.memory import (HeldHeap, hold_freed_memory_until_idle, release_free_memory,
                                    resident_bytes)
from pkv.core.worker.model_setup import ModelSetup, keeps_16_bit, resolve_dtype
from pkv.core.worker.step_timer import StepTimer
from pkv.core.worker.workers import StepInputs, broadcast
from pkv.csrc import cpp_build

_GREEDY = SamplingParams(temperature=0)


class ModelRunner:
    """Runs the model over the KV cache, one flattened batch per step. Under tensor
    parallelism every rank has one; the driver's broadcasts each step's inputs."""

    def __init__(self, config: EngineConfig, setup: ModelSetup, show_progress: bool = True,
                 tp: TPGroup | None = None, num_blocks: int | None = None,
                 extra_block_bytes: int = 0, one_kv_group: bool = False,
                 stage: PipelineStage | None = None) -> None:
        """`num_blocks` fixes the KV pool's size (0: allocate later, `allocate_kv`);
        otherwise it comes from the memory settings, each block also paying for
        `extra_block_bytes` elsewhere (a draft model's KV of the same block).
        `one_kv_group`: every layer reads one block table (a draft model, which reads the
        target's first group's tables), whatever its windows. `stage`: the pipeline stage
        this rank runs (its layers and their KV only)."""
        self.config = config
        self.tp = tp or TPGroup()
        self.stage = stage or PipelineStage()
        # Ranks that run every step in lockstep, fed by the driver's broadcast.
        self.distributed = self.tp.enabled or self.stage.enabled
        source = setup.source
        self.model_config = source.config
        self.plan = ShardPlan.build(source.config, self.tp)
        self.block_size = config.block_size
        self.device = setup.device
        self.dtype = resolve_dtype(config.dtype, source.config, self.device)
        self.kv_format = kv_format(config.kv_cache_dtype, self.dtype, source.config.head_dim)
        layers = self.stage.layers(source.config.num_hidden_layers)
        windows = source.config.layer_windows
        self.kv_groups = plan_kv_groups([None] * len(windows) if one_kv_group
                                        else windows).for_layers(layers)
        method = setup.loader.linear_method(source, self.device) if setup.loader else None
        if isinstance(method, GGMLLinearMethod) and config.dtype == "float32":
            method = None  # asked for float32: a GGUF's blocks are dequantized as they load
        elif method is None and keeps_16_bit(config, source.config, self.device):
            method = GGMLLinearMethod()  # 16-bit weights held as ggml's F16 / BF16
        if config.awq_activations != "float32":
            (method or UnquantizedLinearMethod()).set_activations(config.awq_activations)
        first_rank = self.tp.rank == 0 and self.stage.is_first
        self.model = build_model(source, setup.backend, setup.max_model_len, self.dtype,
                                 self.device, method, show_progress and first_rank,
                                 self.plan, self.stage)
        # An encoder attends within each prompt and keeps no KV: its pool is bookkeeping.
        self.keeps_kv = getattr(self.model, "keeps_kv", True)
        self.pooler: Pooler | None = None
        if setup.task != "generate":
            self.pooler = build_pooler(setup.task, source.config, source.folder, self.model)
        if (int8_lm_head(config.lm_head_quantization, setup.loader, self.device)
                and self.model.lm_head is not None):
            from pkv.core.layers.int8_linear import Int8LinearMethod

            Int8LinearMethod.convert(self.model.lm_head, self.model.lm_head.weight)
        if self.device.type == "cpu":
            move_weights_to_huge_pages(self.model)  # before the C++ decoder takes pointers
        self.lora_batch = LoRABatch()
        self.lora_layers = (attach_lora(self.model, config.max_loras, config.max_lora_rank,
                                        self.lora_batch, self.dtype, self.device,
                                        layers.start)
                            if config.enable_lora else {})
        ops = None
        if self.device.type == "cpu" and self.dtype == torch.float32:
            ops = cpp_build.kernels_or_none()
            if self.keeps_kv:
                self.model.use_kernels(ops, build_fused_decoder(self.model, ops))
            else:  # an encoder: its linears only
                self.model.use_kernels(ops)
        hold_freed_memory_until_idle()  # a step's activations reuse the last step's pages
        self.held_heap = HeldHeap()  # ...within bounds while busy
        release_free_memory()  # what loading and repacking the weights left behind
        if num_blocks is None:  # (every rank the same)
            num_blocks = num_kv_blocks(config, self.kv_groups,
                                       self.kv_bytes_per_block + extra_block_bytes,
                                       self.device, setup.max_model_len, self.distributed)
        self.allocate_kv(num_blocks)
        # The disk tier's view of a pool split over ranks (every rank's).
        self.kv_parts = (KVParts(lambda: self.kv_cache.view(torch.uint8), self._send_to_ranks)
                         if self.distributed and config.kv_offload_dir else None)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(generator, ops.first_argmax if ops is not None else None)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.timer = StepTimer(sync_cuda=self.device.type == "cuda")
        self.rank_weight_bytes = [self.weight_bytes]
        # What adapters are checked against: every rank's LoRA linears, whole.
        self.lora_targets = {path: slots.target for path, slots in self.lora_layers.items()}
        if self.distributed:
            self.rank_weight_bytes = [0] * dist.get_world_size()
            dist.all_gather_object(self.rank_weight_bytes, self.weight_bytes)
            if self.lora_layers:
                ranks: list[dict] = [{}] * dist.get_world_size()
                dist.all_gather_object(ranks, self.lora_targets)
                self.lora_targets = merge_targets(ranks)

    @property
    def weight_bytes(self) -> int:
        """Bytes the model's weights hold in memory (shared tensors counted once)."""
        return sum(self.weight_bytes_by_type.values())

    @property
    def weight_bytes_by_type(self) -> dict[str, int]:
        """`weight_bytes` by storage: ggml block type (Q4_K, Q6_K, ... of a GGUF kept as its
        file stores it) or dtype (float32, ...), largest first."""
        by_type: dict[str, int] = {}
        blocks: set[int] = set()
        for label, tensor in ggml_storage(self.model):
            if tensor.data_ptr() not in blocks:
                blocks.add(tensor.data_ptr())
                by_type[label] = by_type.get(label, 0) + tensor.numel() * tensor.element_size()
        tensors = {t.data_ptr(): t for t in [*self.model.parameters(), *self.model.buffers()]}
        for ptr, t in tensors.items():
            if ptr not in blocks:
                name = str(t.dtype).removeprefix("torch.")
                by_type[name] = by_type.get(name, 0) + t.numel() * t.element_size()
        return dict(sorted(by_type.items(), key=lambda kv: -kv[1]))

    @property
    def kv_bytes_per_block(self) -> int:
        if not self.keeps_kv:
            return 0
        return (2 * self.kv_groups.slots * self.block_size * self.plan.kv_heads[1]
                * self.kv_format.row_bytes)

    @property
    def kv_resident_bytes(self) -> int:
        """KV pool memory the process holds. Blocks are zeroed, so touched, on first use; on a
        CPU the pages they touched are counted (a 2 MB page holds many blocks of a layer, and
        the first block of each layer's K and V brings in a page), elsewhere the blocks."""
        in_ram = resident_bytes(self.kv_cache) if self.keeps_kv else None
        return in_ram if in_ram is not None else self._num_zeroed_blocks * self.kv_bytes_per_block

    def allocate_kv(self, num_blocks: int) -> None:
        """(Re)allocate the KV pool with `num_blocks` blocks."""
        cfg = self.model_config
        self.num_blocks = num_blocks
        self._num_zeroed_blocks = 0
        if not self.keeps_kv:
            self.kv_cache, self.kv_caches = torch.empty(0, device=self.device), []
            return
        # One allocation for all layers; blocks are zeroed on first use (see _zero_new_blocks),
        # so a large pool costs no memory until it is used.
        # A block id holds `slots` layers: each layer uses its slot of its group's blocks.
        shape = (self.kv_groups.slots, 2, num_blocks, self.block_size,
                 self.plan.kv_heads[1], self.kv_format.row)
        self.kv_cache = empty_on_huge_pages(shape, self.kv_format.dtype, self.device)
        self.kv_caches = [(self.kv_cache[s, 0], self.kv_cache[s, 1])
                          for s in self.kv_groups.slot_of[:cfg.num_hidden_layers]]

    def _zero_new_blocks(self, high_watermark: int) -> None:
        # Attention reads whole blocks and masks the unused slots; masked slots must still hold
        # finite numbers (0 * NaN is NaN), so blocks are zeroed before their first use.
        if high_watermark > self._num_zeroed_blocks and self.keeps_kv:
            # As bytes: float8 tensors have no fill kernel.
            self.kv_cache.view(torch.uint8)[:, :, self._num_zeroed_blocks:high_watermark].zero_()
            self._num_zeroed_blocks = high_watermark

    @torch.inference_mode()
    def load_kv_blocks(self, loads: list[tuple[int, torch.Tensor]], high_watermark: int) -> None:
        """Copy blocks' bytes (read from the disk tier) into the pool: split over ranks, the
        driver's part (the other ranks take theirs with the step: KVParts). Blocks are zeroed
        on first use at the step's start, so the zeroing runs first, not over these bytes."""
        self._zero_new_blocks(high_watermark)
        kv = self.kv_cache.view(torch.uint8)  # [slots, 2, N, block_size, heads, row bytes]
        for block_id, data in loads:
            block = kv[:, :, block_id]
            block.copy_(data[:block.numel()].view(block.shape), non_blocking=data.is_pinned())

    def _send_to_ranks(self, message: KVTransfer) -> None:
        """A KVTransfer to every other rank between steps, as a step's inputs go."""
        broadcast(message)

    def _serve_kv(self, step: StepInputs) -> list[Sent]:
        """A worker rank's side of the step's KVTransfer, before its layers run the step
        (after the zeroing of new blocks, which loaded ones may be); the sends in flight."""
        self._zero_new_blocks(step.high_watermark)
        if step.kv is None:
            return []
        if self.kv_parts is None:
            raise RuntimeError("KV parts reached a rank without a KV disk tier")
        return self.kv_parts.serve(step.kv)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput, block_tables: dict[str, list[list[int]]],
                      high_watermark: int, failures: dict[str, Exception] | None = None,
                      kv: KVWork | None = None
                      ) -> tuple[list[Request], VerifyOutput, dict[str, torch.Tensor]]:
        """Run one step; return the requests that sampled and, per request, the tokens it
        gains (one, or with drafts the accepted ones and one more). A request whose sampling
        setup fails (e.g. its grammar) is recorded in `failures` and sampled greedily, for
        the engine to end. Pooling requests (whole prompts) get their pooled vector instead,
        by request id. `kv`: the disk tier's parts to move with the step (the other ranks'
        parts of evicted blocks arrive in `kv.parts`)."""
        chunks, sampling = step_chunks(sched, block_tables)
        input_ids, positions, meta, logits_idx = flatten_batch(
            chunks, self.block_size, self.device, self.kv_groups.group_of)
        pooling = self._pooling(sched)
        step = StepInputs(input_ids, positions, meta, logits_idx, high_watermark,
                          token_types(sched.scheduled, self.device) if pooling else None,
                          kv=kv.transfer if kv is not None else None)
        if self.lora_layers:
            step.lora_segments = self._lora_segments(sched, chunks)
            self._use_lora_segments(step.lora_segments)
            if self.tp.enabled:  # the engine loaded this rank's slots; the others load theirs
                step.lora_loads = [(slot, adapter.weights) for slot, adapter in sched.lora_loads]
        self.timer.lap("prepare_inputs")
        sent = []
        if self.tp.enabled:
            broadcast(step)
            if kv is not None and self.kv_parts is not None:  # (before the all-reduces)
                sent = self.kv_parts.send_loads(kv)
                self.kv_parts.receive_saves(kv)
        hidden = self.forward(step)
        logits = self.logits(hidden, step.logits_idx)
        pooled = self._pool(hidden, pool_spans(meta, pooling), pooling) if pooling else {}
        for done in sent:
            done.wait()
        self.timer.lap("forward")
        if logits is None or not any(c.num_prompt_logits for c in chunks):
            return sampling, self._sample(logits, sched, sampling, failures), pooled
        prompt, sample = split_logits(logits, chunks)
        result = self._sample(sample, sched, sampling, failures)
        result.prompt_logprobs = self._prompt_logprobs(prompt, sched, chunks)
        return sampling, result, pooled

    def _sample(self, logits: torch.Tensor | None, sched: SchedulerOutput,
                sampling: list[Request], failures: dict[str, Exception] | None) -> VerifyOutput:
        if logits is None:
            return VerifyOutput([], [], [])
        drafts = [sched.spec_token_ids.get(r.request_id, []) for r in sampling]
        rows = self._sampling_rows(sampling, drafts, failures)
        if any(drafts):
            result = self.rejection_sampler(logits, rows, drafts)
        else:
            plain = self.sampler(logits, rows)
            result = VerifyOutput([[t] for t in plain.token_ids],
                                  [None if e is None else [e] for e in plain.logprobs],
                                  [0] * len(rows))
        self.timer.lap("sample")
        return result

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, sched: SchedulerOutput,
                         chunks: list[SeqChunk]) -> dict[str, list[LogprobEntry]]:
        """The prompt-logprobs rows' entries (`logits`: theirs, chunk after chunk), by
        request: each row's for the prompt token after it."""
        out, row = {}, 0
        for request, chunk in zip(sched.scheduled, chunks):
            n = chunk.num_prompt_logits
            if n:
                targets = request.all_token_ids[chunk.start + 1:chunk.start + 1 + n]
                out[request.request_id] = prompt_entries(
                    logits[row:row + n], targets, request.sampling_params.prompt_logprobs or 0)
                row += n
        return out

    def _pooling(self, sched: SchedulerOutput) -> list[tuple[Request, int]]:
        """The step's pooling requests whose prompt it ends (a chunked one pools at its last
        chunk), and their places in it."""
        if self.pooler is None:
            return []
        return [(r, i) for i, r in enumerate(sched.scheduled)
                if r.pooling is not None and sched.samples(r)]

    def _pool(self, hidden: torch.Tensor, spans: list[tuple[int, int]],
              pooling: list[tuple[Request, int]]) -> dict[str, torch.Tensor]:
        """Each pooling request's vector, from its rows (its whole prompt: `spans`, first
        row and count, in `hidden`)."""
        if self.pooler is None:
            raise RuntimeError("a pooling request reached a model that generates text")
        vectors = self.pooler(hidden, spans, [r.pooling for r, _ in pooling])
        return {r.request_id: v.cpu() for (r, _), v in zip(pooling, vectors)}

    def load_lora(self, slot: int, weights: dict[str, list[LoRAWeight]]) -> None:
        """Copy an adapter's weights (`LoRAAdapter.weights`) into `slot` of every LoRA
        linear of this rank (a linear it does not adapt gets none)."""
        for path, layer in self.lora_layers.items():
            layer.set(slot, weights.get(path, []))

    @staticmethod
    def _lora_segments(sched: SchedulerOutput,
                       chunks: list[SeqChunk]) -> list[tuple[int, int, int]]:
        return lora_segments([(r.lora_slot, len(c.token_ids))
                              for r, c in zip(sched.scheduled, chunks)])

    def _use_lora_segments(self, segments: list[tuple[int, int, int]]) -> None:
        self.lora_batch.segments = segments
        if self.model.model.fused is not None:
            self.model.model.fused.set_lora_segments(segments)

    @torch.inference_mode()
    def run_step(self, step: StepInputs) -> torch.Tensor | None:
        """The forward pass every tensor-parallel rank runs in lockstep (its adapters' loads
        and runs of rows first); logits of the sampling rows."""
        if self.lora_layers:
            self._use_lora(step)
        sent = self._serve_kv(step)
        logits = self.logits(self.forward(step), step.logits_idx)
        for done in sent:
            done.wait()
        return logits

    def _use_lora(self, step: StepInputs) -> None:
        """A step's adapter loads and runs of rows, on this rank's linears (the loads before
        the step's forward: steps reach a rank in order, so none still running here can
        read a slot being refilled)."""
        for slot, weights in step.lora_loads:
            self.load_lora(slot, weights)
        self._use_lora_segments(step.lora_segments)

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor:
        """The model's last hidden states of every row of the step."""
        self._zero_new_blocks(step.high_watermark)
        extra = {} if step.token_type_ids is None else {"token_type_ids": step.token_type_ids}
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta, **extra)
        self.held_heap.after_step()
        return hidden

    def logits(self, hidden: torch.Tensor, logits_idx: torch.Tensor) -> torch.Tensor | None:
        """Logits of the rows `logits_idx` (None when no row samples)."""
        num_logits = logits_idx.numel()
        if num_logits == 0:
            return None
        # The rows are increasing, so as many as there are rows are all of them (every
        # decode step): no gather.
        rows = hidden if num_logits == hidden.shape[0] else hidden[logits_idx]
        return self.model.compute_logits(rows)

    @torch.inference_mode()
    def forward_chunks(self, chunks: list[SeqChunk], high_watermark: int) -> torch.Tensor | None:
        """Logits of the chunks' last `num_logits` rows each (a draft model's pass)."""
        input_ids, positions, meta, logits_idx = flatten_batch(
            chunks, self.block_size, self.device, self.kv_groups.group_of)
        return self.run_step(StepInputs(input_ids, positions, meta, logits_idx, high_watermark))

    def _sampling_rows(self, sampling: list[Request], drafts: list[list[int]],
                       failures: dict[str, Exception] | None) -> list[SamplingRow]:
        """One row per request, or len(drafts) + 1 rows for a request with drafts: row j
        samples as if the first j drafts had been generated."""
        rows = []
        for request, ds in zip(sampling, drafts):
            for j in range(len(ds) + 1):
                try:
                    rows.append(self._sampling_row(request, ds[:j]))
                except Exception as exc:
                    record_failure(failures, request.request_id, exc)
                    rows.append(SamplingRow(_GREEDY, [], [], None, []))
        return rows

    @staticmethod
    def _sampling_row(request: Request, drafts: list[int]) -> SamplingRow:
        params = request.sampling_params
        banned: list[int] = []
        if request.num_output_tokens + len(drafts) < params.min_tokens:
            banned = [*params.stop_token_ids, *request.eos_token_ids]
        allowed = request.guided.allowed_mask() if request.guided is not None else None
        outputs = request.output_token_ids + drafts if drafts else request.output_token_ids
        if params.bad_words_token_ids:
            banned += params.bad_word_bans(outputs)
        if allowed is not None and banned and not _allows_beyond(allowed, banned):
            banned = []  # the grammar's next token (its end: EOS) is not optional
        return SamplingRow(params, request.prompt_token_ids, outputs, request.generator,
                           banned, allowed, _forced_token(request, drafts))


def _allows_beyond(allowed: torch.Tensor, banned: list[int]) -> bool:
    """Whether the mask `allowed` leaves a token outside `banned`."""
    kept = allowed.clone()
    kept[banned] = False
    return bool(kept.any())


def _forced_token(request: Request, drafts: list[int]) -> int | None:
    """The token the request's thinking budget writes after `drafts` (None: the model's)."""
    if request.thinking is None or request.sampling_params.logprobs is None:
        return None
    budget = copy.copy(request.thinking)  # (its state after the drafts, not changed)
    for token in drafts:
        budget.observe(token)
    return budget.forced()
