"""MicroBatches: the pipeline micro-batches the driver has launched and not yet sampled.

Under pipeline parallelism (P stages) the engine keeps up to P micro-batches in flight: while
stage k runs one, stage k + 1 runs the one before. Each takes its share of the requests, and
a request in flight is neither scheduled again nor preempted until its micro-batch is sampled
(the scheduler is told which requests those are).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from pkv.core.sample.rejection_sampler import VerifyOutput
from pkv.core.sched.request import Request
from pkv.core.sched.scheduler import SchedulerOutput
from pkv.core.worker.kv_parts import KVWork
from pkv.core.worker.pipeline_runner import PendingStep, PipelineModelRunner


@dataclass(slots=True)
class SampledBatch:
    """A micro-batch back from the last stage and sampled: what the engine advances."""

    sched: SchedulerOutput
    sampled: list[Request]
    result: VerifyOutput
    pooled: dict[str, torch.Tensor]
    failures: dict[str, Exception]
    kv: KVWork | None  # the disk tier's parts that moved with it


class MicroBatches:
    """The driver's micro-batches in flight, oldest first."""

    def __init__(self, pipeline: PipelineModelRunner, stages: int) -> None:
        self.pipeline = pipeline
        self.stages = stages
        self._pending: deque[PendingStep] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def full(self) -> bool:
        """Whether every stage has one: the next step samples the oldest."""
        return len(self._pending) >= self.stages

    @property
    def request_ids(self) -> set[str]:
        """Requests in a micro-batch in flight."""
        return {r.request_id for p in self._pending for r in p.sched.scheduled}

    def share(self, live: int) -> int:
        """Requests one micro-batch takes of `live` ones, so that P of them keep every stage
        busy."""
        return max(1, -(-live // self.stages))

    def launch(self, sched: SchedulerOutput, tables: dict[str, list[list[int]]],
               high_watermark: int, failures: dict[str, Exception],
               kv: KVWork | None = None) -> None:
        self._pending.append(self.pipeline.launch(sched, tables, high_watermark, failures, kv))

    def complete_oldest(self) -> SampledBatch:
        """Sample the oldest micro-batch; the requests aborted while it was in flight have
        no output left."""
        pending = self._pending.popleft()
        sampled, result, pooled = self.pipeline.complete(pending, pending.failures)
        gone = {r.request_id for r in pending.sched.scheduled if r.status.finished}
        kept = [i for i, r in enumerate(sampled) if r.request_id not in gone]
        result = VerifyOutput([result.token_ids[i] for i in kept],
                              [result.logprobs[i] for i in kept],
                              [result.num_drafts[i] for i in kept])
        pooled = {rid: v for rid, v in pooled.items() if rid not in gone}
        return SampledBatch(pending.sched, [sampled[i] for i in kept], result, pooled,
                            pending.failures, pending.kv)

    def clear(self) -> None:
        """Forget them (a stage died: nothing more comes back)."""
        self._pending.clear()

    def drain(self) -> list[KVWork]:
        """Take back the final rows of micro-batches still in flight (requests aborted in
        them): until they are, the last stage's sends of them never finish. Returns the
        disk tier's parts that moved with them."""
        works = [p.kv for p in self._pending if p.kv is not None]
        while self._pending:
            try:
                self.pipeline.complete(self._pending.popleft())
            except RuntimeError:  # a dead stage: nothing more will come back
                self._pending.clear()
        return works
