"""PipelineModelRunner: a ModelRunner for one pipeline stage.

The driver (world rank 0, on the first stage) launches each micro-batch: its inputs go down
to the next stage, its layers run, their hidden states follow; `complete` later waits for the
last stage's final hidden states of the sampling rows, makes their logits and samples them.
Several micro-batches are in flight at once (the engine keeps them). Every other rank loops
in `serve_stage`: a step's inputs from the previous stage (the first stage's tensor-parallel
ranks: from the driver's broadcast), hidden states in, its layers, hidden states out, until
a None step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from pkv.core.distributed.pipeline import PipelineStage, recv_object, send_object
from pkv.core.sample.rejection_sampler import VerifyOutput
from pkv.core.sched.request import Request
from pkv.core.sched.scheduler import SchedulerOutput
from pkv.core.worker.input_batch import flatten_batch, pool_spans, step_chunks
from pkv.core.worker.kv_parts import KVTransfer, KVWork
from pkv.core.worker.model_runner import ModelRunner
from pkv.core.worker.workers import StepInputs, broadcast


@dataclass(slots=True)
class PendingStep:
    """A micro-batch launched down the pipeline, not yet sampled."""

    sched: SchedulerOutput
    sampling: list[Request]
    num_logits: int
    sent: list  # the sends in flight (pkv.core.distributed.pipeline.Sent)
    failures: dict[str, Exception]  # its requests' failures so far, by request id
    pooling: list[tuple[Request, int]]  # its pooling requests and their places in it
    pool_lens: list[int]  # their rows, which come back after the sampling rows
    kv: KVWork | None = None  # the disk tier's parts moving with it


class PipelineModelRunner(ModelRunner):
    """A ModelRunner that runs its pipeline stage's layers (see the module docstring)."""

    # --- the driver ------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, block_tables: dict[str, list[list[int]]],
               high_watermark: int, failures: dict[str, Exception] | None = None,
               kv: KVWork | None = None) -> PendingStep:
        """Start a micro-batch down the pipeline: its inputs to the next stage, this stage's
        layers over it, its hidden states after them; return without waiting for the rest
        of the pipeline (`complete` does). `failures`: what already failed for its requests
        (a draft model's step), for `complete` to add to; `kv`: the disk tier's parts to
        move with it (as execute_model)."""
        chunks, sampling = step_chunks(sched, block_tables)
        input_ids, positions, meta, logits_idx = flatten_batch(
            chunks, self.block_size, self.device, self.kv_groups.group_of)
        step = StepInputs(input_ids, positions, meta, logits_idx, high_watermark,
                          kv=kv.transfer if kv is not None else None)
        pooling = self._pooling(sched)
        spans = pool_spans(meta, pooling)
        if pooling:  # the last stage sends their rows back too, after the sampling rows
            step.pool_idx = torch.tensor([j for a, n in spans for j in range(a, a + n)],
                                         dtype=torch.long, device=self.device)
        if self.lora_layers:  # each stage loads the adapters' pairs of its own layers
            step.lora_segments = self._lora_segments(sched, chunks)
            step.lora_loads = [(slot, adapter.weights) for slot, adapter in sched.lora_loads]
        if self.tp.enabled:  # this stage's other tensor-parallel ranks run it too
            broadcast(("step", step), self.tp.group)
        if self.lora_layers:  # later stages need only their own layers' pairs
            self._use_lora(step)
            step.lora_loads = [(slot, {path: pairs for path, pairs in weights.items()
                                       if path not in self.lora_layers})
                               for slot, weights in step.lora_loads]
        sent = send_object(step, self.stage.next, self.stage.objects)
        if kv is not None and self.kv_parts is not None:
            sent += self.kv_parts.send_loads(kv)
        self._zero_new_blocks(high_watermark)
        out = self.model(input_ids, positions, self.kv_caches, meta)
        sent += self.stage.send_next(out)
        self.held_heap.after_step()  # (while the next stage takes the step)
        self.timer.lap("forward")
        return PendingStep(sched, sampling, logits_idx.numel(), sent,
                           {} if failures is None else failures, pooling,
                           [n for _, n in spans], kv)

    @torch.inference_mode()
    def complete(self, pending: PendingStep, failures: dict[str, Exception] | None = None
                 ) -> tuple[list[Request], VerifyOutput, dict[str, torch.Tensor]]:
        """Wait for a launched micro-batch's final hidden states (from the last stage), make
        their logits and sample them; pool the pooling requests' rows (as execute_model)."""
        for sent in pending.sent:
            sent.wait()
        if pending.kv is not None and self.kv_parts is not None:  # (sent before the rows)
            self.kv_parts.receive_saves(pending.kv)
        logits, pooled = None, {}
        if pending.num_logits:
            if self.tp.enabled:  # their shares of the LM head, gathered
                broadcast(("rows", pending.num_logits), self.tp.group)
            logits = self._head_of_rows(pending.num_logits)
        if pending.pooling:
            rows = self.stage.recv_rows((sum(pending.pool_lens), self.model_config.hidden_size),
                                        self.dtype, self.device)
            offsets = itertools.accumulate(pending.pool_lens, initial=0)
            pooled = self._pool(rows, list(zip(offsets, pending.pool_lens)), pending.pooling)
        self.timer.lap("forward")  # the later stages ran it
        return (pending.sampling,
                self._sample(logits, pending.sched, pending.sampling, failures), pooled)

    # --- the other ranks ---------------------------------------------------------------------

    def _head_of_rows(self, num_rows: int) -> torch.Tensor:
        """Logits of the last stage's final hidden states of `num_rows` sampling rows."""
        rows = self.stage.recv_rows((num_rows, self.model_config.hidden_size), self.dtype,
                                    self.device)
        return self.model.compute_logits(rows)

    def _send_to_ranks(self, message: KVTransfer) -> None:
        """A KVTransfer to every other rank between steps, down the pipeline as a step."""
        if self.tp.enabled:
            broadcast(("step", message), self.tp.group)
        for sent in send_object(message, self.stage.next, self.stage.objects):
            sent.wait()

    def stop_stages(self) -> None:
        """The driver's last word to the other ranks: a None step down the pipeline (and
        to this stage's tensor-parallel ranks)."""
        if self.tp.enabled:
            broadcast(None, self.tp.group)
        for sent in send_object(None, self.stage.next, self.stage.objects):
            sent.wait()

    @torch.inference_mode()
    def serve_stage(self) -> None:
        """A worker rank's loop under pipeline parallelism: each step's inputs (from the
        previous stage, or on the first stage from the driver), passed on to the next stage;
        the hidden states in, this stage's layers, out to the next stage or, from the last,
        the sampling rows' final states to the driver; until a None step."""
        stage, sent = self.stage, []
        while True:
            if stage.is_first:  # a tensor-parallel rank of the driver's stage
                message = broadcast(None, self.tp.group)
                if message is not None and message[0] == "rows":
                    self._head_of_rows(message[1])
                    continue
                step = message[1] if message is not None else None
            else:
                step = recv_object(stage.prev, stage.objects)
            for done in sent:  # the previous step's sends, before their tensors go
                done.wait()
            sent = [] if stage.is_last else send_object(step, stage.next, stage.objects)
            if isinstance(step, KVTransfer) and self.kv_parts is not None:  # between steps
                sent += self.kv_parts.serve(step)
                continue
            if not isinstance(step, StepInputs):
                break  # None: the driver stops
            sent += self._serve_kv(step)
            if self.lora_layers:
                self._use_lora(step)
            meta = step.meta
            if meta.groups:  # (the driver numbered its own layers' groups)
                meta = replace(meta, layer_groups=tuple(self.kv_groups.group_of))
            intermediate = None
            if not stage.is_first:
                shape = (step.input_ids.shape[0], self.model_config.hidden_size)
                intermediate = stage.recv_prev(shape, self.dtype, self.device)
            out = self.model(step.input_ids, step.positions, self.kv_caches, meta,
                             intermediate)
            if not stage.is_last:
                sent += stage.send_next(out)
            else:
                if step.logits_idx.numel():
                    sent += stage.send_rows(out[step.logits_idx])
                # Pooling rows go to the driver alone (member 0: the first stage's other
                # members pool nothing and would never receive them).
                if step.pool_idx is not None and stage.member == 0:
                    sent += stage.send_rows(out[step.pool_idx])
            self.held_heap.after_step()
        for done in sent:
            done.wait()


def runner_class(stage: PipelineStage) -> type[ModelRunner]:
    """The runner a rank takes: a PipelineModelRunner where it runs a pipeline stage."""
    return PipelineModelRunner if stage.enabled else ModelRunner
