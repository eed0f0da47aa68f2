"""KVCacheCoordinator: one KVCacheManager per KV group (core/layers/kv_groups.py), one pool.

Each group keeps its own block table per request: a windowed group gives back its blocks
behind the window while a global group keeps all of its own. A request is admitted only when
every group has room (the sum of what each needs is free), and a prefix hit must hold in every
group: a global group needs all of the prefix's blocks, a windowed group only the blocks that
the first token after the prefix can still see.

    prefix of k blocks, first new token at p = k * block_size:
      global group    blocks 0 .. k-1
      window W        blocks (p - W + 1) // block_size .. k-1   (null blocks before those)

With a disk tier (`offload`, models of one group only), evicted hashed blocks are saved to
disk, and a prefix that runs out of RAM hits goes on through the files: those blocks are read
(and verified) when found, get fresh blocks when the request is allocated, and wait in
`pending_loads` for the engine to copy them into the pool before the step's forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pkv.core.sched.block_pool import BlockPool, KVBlock
from pkv.core.sched.kv_cache_manager import KVCacheManager
from pkv.core.sched.request import Request

if TYPE_CHECKING:
    import torch

    from pkv.core.sched.kv_offload import KVOffloadStore


class KVCacheCoordinator:
    """The scheduler's view of the KV cache: per-group tables behind one interface."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 windows: list[int | None], offload: KVOffloadStore | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        # Group 0 keeps the plain hashes (a one-group model caches exactly as before).
        self.groups = [KVCacheManager(num_blocks, block_size, enable_caching, window, self.pool,
                                      tag=b"" if g == 0 else f"#kv-group-{g}".encode())
                       for g, window in enumerate(windows)]
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found
        if offload is not None and len(windows) > 1:
            raise ValueError(f"a KV disk tier serves one KV group, not {len(windows)}")
        self.offload = offload
        # Blocks read from disk for the request at the head of the queue, kept until it is
        # allocated (a request that must wait for blocks is not read again every step):
        # (request id, index of its first disk block, their bytes).
        self._disk_found: tuple[str, int, list[torch.Tensor]] | None = None
        self.pending_loads: list[tuple[int, torch.Tensor]] = []  # (block id, bytes)
        if offload is not None:
            self.pool.on_evict = lambda b: offload.save(b.block_hash, b.key, b.block_id)

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVBlock]], int]:
        """Per group, the cached blocks of the longest prefix every group holds, and the
        tokens it covers. The last token is never taken from the cache."""
        if not self.enable_caching:
            return [[] for _ in self.groups], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        found = [g.cached_blocks(request, max_blocks) for g in self.groups]
        k = max_blocks
        for group, cached in zip(self.groups, found):
            if group.sliding_window is None:
                k = min(k, next((i for i, b in enumerate(cached) if b is None), len(cached)))
        while k > 0 and not all(self._visible_cached(g, c, k)
                                for g, c in zip(self.groups, found)):
            k -= 1
        hits = [self._hits(g, c, k) for g, c in zip(self.groups, found)]
        self.prefix_queries += request.num_tokens
        self.prefix_hits += k * self.block_size
        num_disk = len(self._find_on_disk(request, k, max_blocks))
        return hits, (k + num_disk) * self.block_size

    def _find_on_disk(self, request: Request, start: int, end: int) -> list[torch.Tensor]:
        """Bytes of the request's blocks start.. found in the disk tier, up to a miss."""
        if self.offload is None or start >= end:
            self._disk_found = None
            return []
        found = self._disk_found
        if found is None or found[:2] != (request.request_id, start):
            loaded = self.offload.load_chain((request.block_hashes[i], request.block_key(i))
                                             for i in range(start, end))
            found = (request.request_id, start, loaded)
        self._disk_found = found if found[2] else None
        return found[2]

    def _take_disk_found(self, request: Request, num_hits: int) -> list[torch.Tensor]:
        """The disk blocks get_computed_blocks found for this new request, if any."""
        found = self._disk_found
        if (found is None or request.num_computed_tokens
                or self.groups[0].req_blocks.get(request.request_id)
                or found[:2] != (request.request_id, num_hits)):
            return []
        return found[2]

    def _first_visible(self, group: KVCacheManager, k: int) -> int:
        """The first block the token after a k-block prefix sees in this group."""
        if group.sliding_window is None:
            return 0
        return max(0, k * self.block_size - group.sliding_window + 1) // self.block_size

    def _visible_cached(self, group: KVCacheManager, cached: list[KVBlock | None],
                        k: int) -> bool:
        return all(b is not None for b in cached[self._first_visible(group, k):k])

    def _hits(self, group: KVCacheManager, cached: list[KVBlock | None],
              k: int) -> list[KVBlock]:
        first = self._first_visible(group, k)
        return [group.null_block] * first + [b for b in cached[first:k] if b is not None]

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[list[KVBlock]] | None = None) -> bool:
        """Room for `num_new_tokens` more tokens in every group; False (and no change) if
        the pool runs out."""
        hits = computed_blocks or [[] for _ in self.groups]
        from_disk = self._take_disk_found(request, len(hits[0]))
        # Disk blocks are computed tokens that need fresh blocks: they count as new ones.
        num_new_tokens += len(from_disk) * self.block_size
        need = sum(g.blocks_needed(request, num_new_tokens, h) for g, h in zip(self.groups, hits))
        if need > self.pool.num_free_blocks:
            for group in self.groups:
                if not group.req_blocks.get(request.request_id):
                    group.req_blocks.pop(request.request_id, None)
            return False
        # Every group's hits leave the free queue before any group allocates: an allocation
        # takes from that queue and would evict a hit another group is about to use.
        for group, h in zip(self.groups, hits):
            group.add_hits(request, h)
        for group, h in zip(self.groups, hits):
            group.add_new_blocks(request, num_new_tokens, len(h))
        if from_disk and self.offload is not None:  # (from_disk comes from the tier)
            fresh = self.groups[0].req_blocks[request.request_id][len(hits[0]):]
            self.pending_loads += [(b.block_id, data) for b, data in zip(fresh, from_disk)]
            self._disk_found = None
            self.offload.record_hits(len(from_disk), len(from_disk) * self.block_size)
        return True

    def free(self, request: Request) -> None:
        if self._disk_found is not None and self._disk_found[0] == request.request_id:
            self._disk_found = None
        for group in self.groups:
            group.free(request)

    def take_loads(self) -> list[tuple[int, torch.Tensor]]:
        """The (block id, bytes) read from disk that must be in the pool before the next
        forward; the caller copies them in."""
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def save_cached_blocks(self) -> int:
        """Write every free hashed block to the disk tier (a graceful shutdown: those a
        restart would otherwise lose); returns how many were offered."""
        if self.offload is None:
            return 0
        blocks = self.pool.free_cached_blocks()
        for block in blocks:
            if block.block_hash is not None and block.key is not None:
                self.offload.save(block.block_hash, block.key, block.block_id, wait=True)
        return len(blocks)

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table of each group."""
        return [g.block_ids(request_id) for g in self.groups]

    def request_blocks(self, request_id: str) -> list[list[KVBlock]]:
        return [g.req_blocks.get(request_id, []) for g in self.groups]

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks
