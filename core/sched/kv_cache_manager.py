"""KVCacheManager: block tables per request on top of the BlockPool, with prefix reuse.

With a sliding window on every layer, a running request's blocks that lie wholly before the
window of its next token are never read again: they go back to the pool at once, and their
place in the block table holds a null block (id 0, never read through this table), so a
long generation holds about `window` tokens of KV instead of its whole length.

    tokens  [ block 0 | block 1 | block 2 | block 3 | block 4 ]   next token at position p
                null      null   |<------ window: p - W + 1 .. p ------>|

With a disk tier (`offload`), evicted hashed blocks are saved to disk, and a prefix that
runs out of RAM hits goes on through the files: those blocks are read (and verified) when
found, get fresh blocks when the request is allocated, and wait in `pending_loads` for the
engine to copy them into the pool before the step's forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pkv.core.sched.block_pool import BlockPool, KVBlock
from pkv.core.sched.request import Request

if TYPE_CHECKING:
    import torch

    from pkv.core.sched.kv_offload import KVOffloadStore


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates blocks as requests grow, finds cached prefixes, frees on finish/preempt."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 sliding_window: int | None = None,
                 offload: KVOffloadStore | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.null_block = KVBlock(0)  # a table placeholder; never allocated, never freed
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are hashed
        self._num_released: dict[str, int] = {}  # leading blocks given back (sliding window)
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found
        self.offload = offload
        # Blocks read from disk for the request at the head of the queue, kept until it is
        # allocated (a request that must wait for blocks is not read again every step):
        # (request id, index of its first disk block, their bytes).
        self._disk_found: tuple[str, int, list[torch.Tensor]] | None = None
        self.pending_loads: list[tuple[int, torch.Tensor]] = []  # (block id, bytes)
        if offload is not None:
            self.pool.on_evict = lambda b: offload.save(b.block_hash, b.key, b.block_id)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks of the request's tokens, and the tokens it covers.

        The last token is never taken from the cache: its logits must be computed.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.pool.lookup(block_hash, request.block_key(i))
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        num_disk = len(self._find_on_disk(request, len(hits), max_blocks))
        return hits, (len(hits) + num_disk) * self.block_size

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

    def _take_disk_found(self, request: Request, num_computed_blocks: int) -> list[torch.Tensor]:
        """The disk blocks get_computed_blocks found for this new request, if any."""
        found = self._disk_found
        if (found is None or request.num_computed_tokens or request.request_id in self.req_blocks
                or found[:2] != (request.request_id, num_computed_blocks)):
            return []
        return found[2]

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if blocks run out."""
        computed_blocks = computed_blocks or []
        from_disk = self._take_disk_found(request, len(computed_blocks))
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = (request.num_computed_tokens
                        + (len(computed_blocks) + len(from_disk)) * self.block_size)
        self._release_behind_window(request.request_id, blocks, num_computed)
        # Disk blocks need fresh blocks: they are part of `need`, first in line.
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks)
        need -= len(computed_blocks)
        # Cache hits sitting in the free queue stop being free once we take them.
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reclaimed:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        if need > 0:
            new = self.pool.allocate(need)
            self.pending_loads += [(b.block_id, data) for b, data in zip(new, from_disk)]
            blocks.extend(new)
        if from_disk:
            self._disk_found = None
            assert self.offload is not None  # from_disk comes from it
            self.offload.record_hits(len(from_disk), len(from_disk) * self.block_size)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return True

    def _release_behind_window(self, request_id: str, blocks: list[KVBlock],
                               first_query: int) -> None:
        """Give back the blocks no query from position `first_query` on can see."""
        if self.sliding_window is None:
            return
        done = self._num_released.get(request_id, 0)
        end = min(len(blocks), max(0, first_query - self.sliding_window + 1) // self.block_size)
        if end <= done:
            return
        # Tail-first within the released run, as `free` does, so older blocks evict first.
        self.pool.free(list(reversed(blocks[done:end])))
        blocks[done:end] = [self.null_block] * (end - done)
        self._num_released[request_id] = end

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # Blocks are registered when scheduled, before their K/V exist: every step writes all
        # K/V before any attention, so a sharer scheduled in the same step reads them filled.
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            if blocks[i] is self.null_block:
                continue
            self.pool.cache(blocks[i], request.block_hashes[i], request.block_key(i))
        self._num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Return a request's blocks to the pool, tail first (tails are evicted first)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        if self._disk_found is not None and self._disk_found[0] == request.request_id:
            self._disk_found = None
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_released.pop(request.request_id, None)
        self.pool.free([b for b in reversed(blocks) if b is not self.null_block])

    def save_cached_blocks(self) -> int:
        """Write every free hashed block to the disk tier (a graceful shutdown: those a
        restart would otherwise lose); returns how many were offered."""
        if self.offload is None:
            return 0
        blocks = self.pool.free_cached_blocks()
        for block in blocks:
            assert block.block_hash is not None and block.key is not None
            self.offload.save(block.block_hash, block.key, block.block_id, wait=True)
        return len(blocks)

    def take_loads(self) -> list[tuple[int, torch.Tensor]]:
        """The (block id, bytes) read from disk that must be in the pool before the next
        forward; the caller copies them in."""
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks
