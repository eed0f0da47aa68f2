"""KVCacheCoordinator: one KVCacheManager per KV group (core/layers/kv_groups.py), one pool.

Each group keeps its own block table per request: a windowed group gives back its blocks
behind the window while a global group keeps all of its own. A request is admitted only when
every group has room (the sum of what each needs is free), and a prefix hit must hold in every
group: a global group needs all of the prefix's blocks, a windowed group only the blocks that
the first token after the prefix can still see.

    prefix of k blocks, first new token at p = k * block_size:
      global group    blocks 0 .. k-1
      window W        blocks (p - W + 1) // block_size .. k-1   (null blocks before those)

With a disk tier (`offload`), evicted hashed blocks are saved to disk (each group's under its
own hashes), and a prefix longer than RAM holds is looked for block by block in RAM or on disk:
the longest prefix every group can serve (its global groups' blocks, its windowed groups'
visible ones) wins; the blocks found only on disk are read (and verified), get fresh blocks
when the request is allocated, and wait in `pending_loads` for the engine to copy them into
the pool before the step's forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pkv.core.sched.block_pool import BlockPool, KVBlock
from pkv.core.sched.kv_cache_manager import KVCacheManager
from pkv.core.sched.request import Request

if TYPE_CHECKING:
    import torch

    from pkv.core.sched.kv_offload import KVOffloadStore


@dataclass
class DiskHit:
    """A request's prefix of `end` blocks, `start` of them hits in RAM: per group, its blocks
    (None where read from disk) and the bytes of those read, in order."""

    request_id: str
    start: int
    end: int
    blocks: list[list[KVBlock | None]]
    data: list[list[torch.Tensor]]


class KVCacheCoordinator:
    """The scheduler's view of the KV cache: per-group tables behind one interface."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 windows: list[int | None], offload: KVOffloadStore | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        # Group 0 keeps the plain hashes: a one-group model's keys (and its disk tier's files)
        # are those of a model without groups.
        self.groups = [KVCacheManager(num_blocks, block_size, enable_caching, window, self.pool,
                                      tag=b"" if g == 0 else f"#kv-group-{g}".encode())
                       for g, window in enumerate(windows)]
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found in RAM (the disk tier counts its own)
        self._ram_hit: tuple[str, int] | None = None  # the last lookup's (request, RAM tokens)
        self.offload = offload
        # Blocks read from disk for the request at the head of the queue, kept until it is
        # allocated (a request that must wait for blocks is not read again every step).
        self._disk_found: DiskHit | None = None
        self.pending_loads: list[tuple[int, torch.Tensor]] = []  # (block id, bytes)
        self._loading: list[int] = []  # blocks taken for loading since the last whole step
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
        self._ram_hit = (request.request_id, k * self.block_size)
        disk = self._find_on_disk(request, found, k, max_blocks)
        if disk is None:
            return hits, k * self.block_size
        return disk.blocks, disk.end * self.block_size

    def record_prefix_hit(self, request: Request, num_cached: int) -> None:
        """Count a request's lookup once, as it is admitted with `num_cached` tokens from the
        cache (a request waiting for blocks is looked up again every step); of those, the
        ones its lookup found in RAM are hits here."""
        if not self.enable_caching:
            return
        self.prefix_queries += request.num_tokens
        last, self._ram_hit = self._ram_hit, None
        self.prefix_hits += last[1] if last is not None and last[0] == request.request_id \
            else num_cached

    def _find_on_disk(self, request: Request, found: list[list[KVBlock | None]], k: int,
                      max_blocks: int) -> DiskHit | None:
        """A longer prefix than RAM's `k` blocks, its missing blocks read from disk."""
        failed: set[tuple[int, int]] = set()  # (group, block) whose file did not read
        while self.offload is not None and k < max_blocks:
            plan = self._disk_plan(request, found, k, max_blocks, failed)
            if plan is None:
                break
            memo = self._disk_found
            if (memo is not None and (memo.request_id, memo.start, memo.end)
                    == (request.request_id, k, plan.end)
                    and self._disk_places(memo) == self._disk_places(plan)):
                plan.data = memo.data  # (read while it waited for blocks)
                self._disk_found = plan
                return plan
            if self._read(self.offload, request, plan, failed):
                self._disk_found = plan
                return plan
        self._disk_found = None
        return None

    def _read(self, offload: KVOffloadStore, request: Request, plan: DiskHit,
              failed: set[tuple[int, int]]) -> bool:
        """Read the plan's disk blocks into `plan.data`; False at the first file that does not
        read (added to `failed`: the plan is made again without it, so nothing after it is
        read for this one)."""
        for g, (group, blocks) in enumerate(zip(self.groups, plan.blocks)):
            for i in (i for i, b in enumerate(blocks) if b is None):
                data = offload.load(*group.cache_key(request, i))
                if data is None:
                    failed.add((g, i))
                    return False
                plan.data[g].append(data)
        return True

    def _disk_plan(self, request: Request, found: list[list[KVBlock | None]], k: int,
                   max_blocks: int, failed: set[tuple[int, int]]) -> DiskHit | None:
        """The longest prefix every group holds in RAM (`found`) or on disk (unread yet)."""
        offload = self.offload
        if offload is None:
            return None
        on_disk: dict[tuple[int, int], bool] = {}

        def held(g: int, i: int) -> bool:
            if found[g][i] is not None:
                return True
            if (g, i) not in on_disk:  # (asked lazily: a windowed group needs few blocks)
                on_disk[g, i] = ((g, i) not in failed
                                 and offload.has(self.groups[g].cache_key(request, i)[0]))
            return on_disk[g, i]

        end = max_blocks
        for g, group in enumerate(self.groups):
            if group.sliding_window is None:
                end = next((i for i in range(end) if not held(g, i)), end)
        while end > k and not all(held(g, i) for g, group in enumerate(self.groups)
                                  for i in range(self._first_visible(group, end), end)):
            end -= 1
        if end <= k:
            return None
        firsts = [self._first_visible(g, end) for g in self.groups]
        blocks = [[g.null_block] * first + cached[first:end]
                  for g, first, cached in zip(self.groups, firsts, found)]
        return DiskHit(request.request_id, k, end, blocks, [[] for _ in self.groups])

    @staticmethod
    def _disk_places(hit: DiskHit) -> set[tuple[int, int]]:
        return {(g, i) for g, blocks in enumerate(hit.blocks)
                for i, b in enumerate(blocks) if b is None}

    def _take_disk_found(self, request: Request,
                         hits: list[list[KVBlock | None]]) -> DiskHit | None:
        """What get_computed_blocks found on disk for this new request, if `hits` is it."""
        found = self._disk_found
        if (found is None or request.num_computed_tokens
                or self.groups[0].req_blocks.get(request.request_id)
                or found.request_id != request.request_id or found.blocks is not hits):
            return None
        return found

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
                       computed_blocks: list[list[KVBlock | None]] | None = None) -> bool:
        """Room for `num_new_tokens` more tokens in every group; False (and no change) if
        the pool runs out. `computed_blocks`: get_computed_blocks' hits (a None: a block
        read from disk, which takes a fresh block)."""
        hits = computed_blocks or [[] for _ in self.groups]
        disk = self._take_disk_found(request, hits)
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
        if disk is not None:
            self._place_loads(request, disk)
        for group, h in zip(self.groups, hits):
            group.add_new_blocks(request, num_new_tokens, len(h))
        return True

    def _place_loads(self, request: Request, disk: DiskHit) -> None:
        """Fresh blocks for the blocks read from disk, their bytes queued for the pool."""
        for group, data in zip(self.groups, disk.data):
            fresh = self.pool.allocate(len(data))
            group.fill_loaded(request, fresh)
            self.pending_loads += [(b.block_id, d) for b, d in zip(fresh, data)]
        self._disk_found = None
        if self.offload is not None:
            self.offload.record_hits(sum(len(d) for d in disk.data),
                                     (disk.end - disk.start) * self.block_size)

    def free(self, request: Request) -> None:
        if self._disk_found is not None and self._disk_found.request_id == request.request_id:
            self._disk_found = None
        for group in self.groups:
            group.free(request)

    def forget_unwritten(self, request: Request) -> None:
        """After a failed step: no hash may find a block whose K/V it did not write."""
        for group in self.groups:
            group.forget_unwritten(request)

    def take_loads(self) -> list[tuple[int, torch.Tensor]]:
        """The (block id, bytes) read from disk that must be in the pool before the next
        forward; the caller copies them in."""
        loads, self.pending_loads = self.pending_loads, []
        self._loading += [block_id for block_id, _ in loads]
        return loads

    def loads_landed(self) -> None:
        """The step that took the loads ran whole: their bytes are in every rank's pool."""
        self._loading = []

    def forget_loads(self) -> None:
        """After a failed step: blocks read from disk for it may not have reached the pool
        (or another rank's part of it), so no hash may find them."""
        for block_id in self._loading + [block_id for block_id, _ in self.pending_loads]:
            self.pool.forget(self.pool.blocks[block_id])
        self._loading, self.pending_loads = [], []

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

    def held_from(self, request_id: str) -> int:
        """The first position whose block the request's first group still holds."""
        return self.groups[0].held_from(request_id)

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table of each group."""
        return [g.block_ids(request_id) for g in self.groups]

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks
