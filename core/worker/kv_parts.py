"""KVParts: the KV disk tier's view of a pool split over tensor-parallel ranks.

Each rank holds its KV heads of every block. A block on disk holds every rank's part, in rank
order (the driver's first), so one file, one key and one checksum stand for the whole block
and no rank can hit where another misses. The driver saves and loads files
(core/sched/kv_offload.py); the other ranks' parts travel in collectives it asks for between
steps, while those ranks wait for the next one:

    eviction   driver copies its part, then KVPartsRequest: every rank packs its parts of the
               blocks, gathered to the driver, which completes the files' bytes
    disk hit   KVLoadRequest: the driver scatters each rank its parts of the blocks read,
               every rank copies its own into the pool (before the step that reads them)

Ranks' parts differ when KV heads split unevenly (3 heads: 2 + 1); collectives carry them
padded to the widest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pkv.core.distributed.parallel import TPGroup
from pkv.core.worker.workers import broadcast


@dataclass
class KVPartsRequest:
    """The driver asks every rank for its parts of `block_ids` (to save them)."""

    block_ids: list[int]


@dataclass
class KVLoadRequest:
    """The driver sends every rank its parts of `block_ids` (read from disk) to copy in, after
    zeroing the blocks below `high_watermark` that are new."""

    block_ids: list[int]
    high_watermark: int


class KVParts:
    """This rank's parts of KV blocks, and every rank's part size."""

    def __init__(self, pool: Callable[[], torch.Tensor], tp: TPGroup) -> None:
        """`pool` returns this rank's KV pool as bytes [slots, 2, num_blocks, ...]; every rank
        of `tp` builds one at once (the sizes are exchanged)."""
        self._pool = pool
        self.tp = tp
        own = pool()[:, :, 0].numel()
        sizes: list[int] = [0] * tp.size
        dist.all_gather_object(sizes, own, group=tp.group)
        self.sizes = sizes
        self._offsets = [sum(sizes[:r]) for r in range(len(sizes))]  # in a whole block
        self._width = max(sizes)
        self._driver = 0 if tp.group is None else dist.get_global_rank(tp.group, 0)

    @property
    def remote_bytes(self) -> int:
        """A block's bytes on the other ranks."""
        return sum(self.sizes) - self.sizes[self.tp.rank]

    def fetch(self, block_ids: list[int]) -> torch.Tensor:
        """The driver: the other ranks' parts of the blocks [blocks, remote_bytes]."""
        broadcast(KVPartsRequest(block_ids), self.tp.group)
        parts = self.gather(block_ids)
        if parts is None:
            raise RuntimeError("only the driver fetches KV parts")
        return parts

    def send(self, block_ids: list[int], blocks: list[torch.Tensor],
             high_watermark: int) -> None:
        """The driver: every rank's part of the blocks read from disk into its pool."""
        broadcast(KVLoadRequest(block_ids, high_watermark), self.tp.group)
        self.scatter(block_ids, blocks)

    def gather(self, block_ids: list[int]) -> torch.Tensor | None:
        """Every rank calls it: the other ranks' parts of the blocks, on the driver
        [blocks, remote_bytes] (None on the other ranks)."""
        pool = self._pool()
        own = self.sizes[self.tp.rank]
        mine = torch.zeros(len(block_ids), self._width, dtype=torch.uint8, device=pool.device)
        for i, block in enumerate(block_ids):
            mine[i, :own] = pool[:, :, block].reshape(-1)
        if self.tp.rank != 0:
            dist.gather(mine, dst=self._driver, group=self.tp.group)
            return None
        parts = [torch.empty_like(mine) for _ in self.sizes]
        dist.gather(mine, parts, dst=self._driver, group=self.tp.group)
        return torch.cat([p[:, :n] for p, n in zip(parts[1:], self.sizes[1:])], dim=1).cpu()

    def scatter(self, block_ids: list[int], blocks: list[torch.Tensor] | None = None) -> None:
        """Copy this rank's part of each block into the pool: the driver gives the whole
        blocks' bytes (`blocks`), the other ranks receive theirs."""
        pool, own = self._pool(), self.sizes[self.tp.rank]
        mine = torch.empty(len(block_ids), self._width, dtype=torch.uint8, device=pool.device)
        if self.tp.rank == 0:
            if blocks is None:
                raise ValueError("the driver scatters the blocks it read")
            parts = [torch.zeros_like(mine) for _ in self.sizes]
            for i, data in enumerate(blocks):
                for part, start, n in zip(parts, self._offsets, self.sizes):
                    part[i, :n] = data[start:start + n].to(pool.device)
            dist.scatter(mine, parts, src=self._driver, group=self.tp.group)
        else:
            dist.scatter(mine, src=self._driver, group=self.tp.group)
        for i, block in enumerate(block_ids):
            target = pool[:, :, block]
            target.copy_(mine[i, :own].view(target.shape))
