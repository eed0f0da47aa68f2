"""KVParts: the KV disk tier's view of a pool split over ranks.

Under tensor parallelism each rank holds its KV heads of every block, under pipeline
parallelism each stage its layers' (with both, each rank its heads of its stage's layers). A
block on disk holds every rank's part, in world-rank order (the driver's first), so one file,
one key and one checksum stand for the whole block and no rank can hit where another misses.
The driver saves and loads files (core/sched/kv_offload.py); the other ranks' parts travel
point to point with the step that needs them (`KVTransfer`, in StepInputs.kv), so a
pipeline keeps its micro-batches in flight:

    eviction   the driver copies its part while it schedules; every other rank sends the
               driver its parts before its layers run the step (which may overwrite them);
               the driver takes them with the step's results
    disk hit   the driver copies its part in before the step and sends every other rank its
               parts, which that rank copies in before its layers run the step

At shutdown, when the blocks still cached are saved, a KVTransfer travels alone as a step
would. Ranks' parts differ when KV heads or layers split unevenly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pkv.core.distributed.pipeline import Sent

# gloo matches a receive to a send by peer and tag: the disk tier's parts never meet a step's
# hidden states or rows on the way (which travel, and are received, in another order).
KV_TAG = 7


@dataclass
class KVTransfer:
    """What every rank but the driver does with its parts of KV blocks for one step: send
    the driver those of `save` (evicted), take those of `load` (read from disk)."""

    save: list[int] = field(default_factory=list)
    load: list[int] = field(default_factory=list)


@dataclass
class KVWork:
    """The driver's side of a step's KVTransfer."""

    transfer: KVTransfer
    blocks: list[torch.Tensor] = field(default_factory=list)  # whole bytes of `load`'s blocks
    due: list[Any] = field(default_factory=list)  # the disk tier's entries awaiting `parts`
    parts: torch.Tensor | None = None  # the other ranks' parts of `save`, once received


class KVParts:
    """This rank's parts of KV blocks, and every rank's part size."""

    def __init__(self, pool: Callable[[], torch.Tensor],
                 send: Callable[[KVTransfer], None]) -> None:
        """`pool` returns this rank's KV pool as bytes [slots, 2, num_blocks, ...]; `send`
        gives a KVTransfer to every other rank between steps (the driver's runner does).
        Every rank of the world builds one at once (the sizes are exchanged)."""
        self._pool = pool
        self._send = send
        self.rank = dist.get_rank()
        sizes: list[int] = [0] * dist.get_world_size()
        dist.all_gather_object(sizes, pool()[:, :, 0].numel())
        self.sizes = sizes
        self._offsets = [sum(sizes[:r]) for r in range(len(sizes))]  # in a whole block

    @property
    def remote_bytes(self) -> int:
        """A block's bytes on the other ranks."""
        return sum(self.sizes) - self.sizes[0]

    # --- the driver ------------------------------------------------------------------------

    def send_loads(self, work: KVWork) -> list[Sent]:
        """Every other rank its parts of the blocks read from disk (the driver copies its
        own: ModelRunner.load_kv_blocks), without waiting."""
        if not work.transfer.load:
            return []
        device = self._pool().device
        sent = []
        for rank in range(1, len(self.sizes)):
            start, n = self._offsets[rank], self.sizes[rank]
            part = torch.stack([data[start:start + n] for data in work.blocks]).to(device)
            sent.append(Sent(dist.isend(part, rank, tag=KV_TAG), part))
        return sent

    def receive_saves(self, work: KVWork) -> None:
        """The other ranks' parts of the evicted blocks into `work.parts`, [blocks,
        remote_bytes] in rank order, on the CPU."""
        if not work.transfer.save:
            return
        device, count = self._pool().device, len(work.transfer.save)
        parts = [torch.empty(count, n, dtype=torch.uint8, device=device) for n in self.sizes[1:]]
        for rank, part in enumerate(parts, start=1):
            dist.recv(part, rank, tag=KV_TAG)
        work.parts = torch.cat(parts, dim=1).cpu()

    def fetch(self, block_ids: list[int]) -> torch.Tensor:
        """The other ranks' parts of the blocks [blocks, remote_bytes], between steps."""
        if self.rank != 0:
            raise RuntimeError("only the driver fetches KV parts")
        work = KVWork(KVTransfer(save=block_ids))
        self._send(work.transfer)
        self.receive_saves(work)
        if work.parts is None:
            raise RuntimeError("no KV parts came back")
        return work.parts

    # --- the other ranks -----------------------------------------------------------------

    def serve(self, transfer: KVTransfer) -> list[Sent]:
        """This rank's side, before its layers run the step: its parts of the evicted
        blocks copied out (a block may be evicted and loaded into at once), its parts of
        the loaded ones in, then the evicted ones' sent to the driver (not waited for; the
        order the driver sends and receives in, as NCCL needs)."""
        pool = self._pool()
        mine = (torch.stack([pool[:, :, block].reshape(-1) for block in transfer.save])
                if transfer.save else None)
        if transfer.load:
            part = torch.empty(len(transfer.load), self.sizes[self.rank], dtype=torch.uint8,
                               device=pool.device)
            dist.recv(part, 0, tag=KV_TAG)
            for i, block in enumerate(transfer.load):
                target = pool[:, :, block]
                target.copy_(part[i].view(target.shape))
        return [] if mine is None else [Sent(dist.isend(mine, 0, tag=KV_TAG), mine)]
