"""BlockPool: the fixed set of KV blocks, their reference counts and the prefix-cache map.

Free blocks wait in one ordered queue; allocation takes from the front:

    front [ freed, uncached | never used, by id | freed with a hash, least recent first ] back

A freed block whose contents are hashed stays findable by its hash until allocation reaches
it (LRU eviction). Freed blocks without a hash go to the front so that memory already touched
is reused before fresh pages. Hashes are SHA-256 chained from the parent block; a hit is
still confirmed against the block's key (parent hash, token ids, salt), so even a hash
collision can never hand a request the KV of other tokens.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block of `block_size` token slots in every layer's cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    key: BlockKey | None = None  # what the hash stands for, to confirm hits


# (parent block hash, token ids, extra such as the cache salt)
BlockKey = tuple[bytes | None, tuple[int, ...], bytes]


class BlockPool:
    """Hands out blocks, takes them back, and keeps hashed blocks reusable until evicted."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}
        # Blocks with id < high_watermark have been handed out at least once (see ModelRunner).
        self.high_watermark = 0
        self.num_evictions = 0
        # Called with each hashed block allocation is about to reuse, while its KV is still
        # intact (the disk tier saves it then: core/sched/kv_offload.py).
        self.on_evict: Callable[[KVBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the front of the free queue, evicting their cached hashes."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")  # caller checks
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None and self.on_evict is not None:
                try:
                    self.on_evict(block)
                except Exception:  # a save that fails loses a disk copy, not the pool's books
                    logger.exception("offering evicted block %d to the disk tier failed",
                                     block.block_id)
            self._evict(block)
            block.ref_cnt = 1
            self.high_watermark = max(self.high_watermark, block.block_id + 1)
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks found by hash (removing them from the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference per block; pass a request's blocks tail-first so tails evict first."""
        for block in blocks:
            if block.ref_cnt <= 0:  # an explicit check: `python -O` drops asserts
                raise RuntimeError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: bytes, key: BlockKey) -> KVBlock | None:
        """The cached block with this hash, if it really holds `key`."""
        block = self._cached.get(block_hash)
        return block if block is not None and block.key == key else None

    def cache(self, block: KVBlock, block_hash: bytes, key: BlockKey) -> None:
        """Make a full block findable by its hash (the first block with a hash keeps it)."""
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash, block.key = block_hash, key
            self._cached[block_hash] = block

    def forget(self, block: KVBlock) -> None:
        """Make a block unfindable by its hash: its K/V were never written (not an eviction)."""
        if block.block_hash is not None:
            self._evict(block)
            self.num_evictions -= 1

    def free_cached_blocks(self) -> list[KVBlock]:
        """The free blocks still findable by hash, least recently used first."""
        return [b for b in self._free.values() if b.block_hash is not None]

    def reset_prefix_cache(self) -> int:
        """Forget every hash of a free block; returns how many were dropped."""
        dropped = self.free_cached_blocks()
        for block in dropped:
            self.forget(block)  # a reset is not pressure on the pool
        return len(dropped)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = block.key = None
            self.num_evictions += 1
