"""KVCacheManager: block tables per request on top of the BlockPool, with prefix reuse.

With a sliding window on every layer, a running request's blocks that lie wholly before the
window of its next token are never read again: they go back to the pool at once, and their
place in the block table holds a null block (id 0, never read through this table), so a
long generation holds about `window` tokens of KV instead of its whole length.

    tokens  [ block 0 | block 1 | block 2 | block 3 | block 4 ]   next token at position p
                null      null   |<------ window: p - W + 1 .. p ------>|
"""

from __future__ import annotations

from pkv.core.sched.block_pool import BlockKey, BlockPool, KVBlock
from pkv.core.sched.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates blocks as requests grow, finds cached prefixes, frees on finish/preempt."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 sliding_window: int | None = None, pool: BlockPool | None = None,
                 tag: bytes = b"") -> None:
        """`pool` shares blocks with other groups' managers (core/sched/kv_cache_coordinator.py);
        `tag` sets this group's cached blocks apart from theirs (same tokens, other layers)."""
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.null_block = KVBlock(0)  # a table placeholder; never allocated, never freed
        self.enable_caching = enable_caching
        self.pool = pool or BlockPool(num_blocks, enable_caching)
        self.tag = tag
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are hashed
        self._num_released: dict[str, int] = {}  # leading blocks given back (sliding window)
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks of the request's tokens, and the tokens it covers.

        The last token is never taken from the cache: its logits must be computed.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block in self.cached_blocks(request, max_blocks):
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_hit(self, request: Request, num_cached: int) -> None:
        """Count a request's lookup once, as it is admitted with `num_cached` tokens from the
        cache (a request waiting for blocks is looked up again every step)."""
        if not self.enable_caching:
            return
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_cached

    def cached_blocks(self, request: Request, num_blocks: int) -> list[KVBlock | None]:
        """The cached block (or None) of each of the request's first `num_blocks` blocks."""
        return [self.pool.lookup(*self.cache_key(request, i))
                for i in range(min(num_blocks, len(request.block_hashes)))]

    def cache_key(self, request: Request, i: int) -> tuple[bytes, BlockKey]:
        """The hash and key block `i` of the request is cached under in this group (and
        saved under in the disk tier)."""
        parent, tokens, salt = request.block_key(i)
        return request.block_hashes[i] + self.tag, (parent, tokens, salt + self.tag)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if blocks run out."""
        need = self.blocks_needed(request, num_new_tokens, computed_blocks)
        if need > self.pool.num_free_blocks:
            if not self.req_blocks.get(request.request_id):
                self.req_blocks.pop(request.request_id, None)
            return False
        self.take_slots(request, num_new_tokens, computed_blocks)
        return True

    def blocks_needed(self, request: Request, num_new_tokens: int,
                      computed_blocks: list[KVBlock] | None = None) -> int:
        """Free blocks `take_slots` would use (cache hits that sit in the free queue count:
        they stop being free; so does a None in `computed_blocks`, a block read from disk).
        Gives back the blocks behind the window first."""
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        self._release_behind_window(request.request_id, blocks, num_computed)
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks)
        need -= len(computed_blocks)
        reclaimed = sum(1 for b in computed_blocks
                        if b is None or (b.ref_cnt == 0 and b is not self.null_block))
        return max(0, need) + reclaimed

    def take_slots(self, request: Request, num_new_tokens: int,
                   computed_blocks: list[KVBlock] | None = None) -> None:
        """Add `computed_blocks` and new blocks for `num_new_tokens` (checked by
        `blocks_needed`)."""
        computed_blocks = computed_blocks or []
        self.add_hits(request, computed_blocks)
        self.add_new_blocks(request, num_new_tokens, len(computed_blocks))

    def add_hits(self, request: Request, computed_blocks: list[KVBlock | None]) -> None:
        """Take the prefix hits: out of the free queue before any allocation can evict them
        (with several groups, all groups' hits go first). A None is a block read from disk:
        its place waits for `fill_loaded`."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if not blocks:  # a hit behind a window starts with null blocks: already given back
            leading = next((i for i, b in enumerate(computed_blocks) if b is not self.null_block),
                           len(computed_blocks))
            if leading:
                self._num_released[request.request_id] = leading
        self.pool.touch([b for b in computed_blocks if b is not None and b is not self.null_block])
        blocks.extend(computed_blocks)  # (its Nones until fill_loaded)

    def fill_loaded(self, request: Request, fresh: list[KVBlock]) -> None:
        """Fresh blocks, in order, in the places `add_hits` kept for blocks read from disk."""
        blocks = self.req_blocks[request.request_id]
        places = [i for i, b in enumerate(blocks) if b is None]
        if len(places) != len(fresh):
            raise RuntimeError(f"{len(fresh)} blocks for {len(places)} places read from disk")
        for i, block in zip(places, fresh):
            blocks[i] = block

    def add_new_blocks(self, request: Request, num_new_tokens: int, num_hits: int) -> None:
        """Blocks for `num_new_tokens` after the computed tokens and `num_hits` hit blocks."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_hits * self.block_size
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)

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
            self.pool.cache(blocks[i], *self.cache_key(request, i))
        self._num_cached_blocks[request.request_id] = max(start, end)

    def forget_unwritten(self, request: Request) -> None:
        """Drop the hashes of the request's blocks from its first token without K/V on: a
        step that registered them (`_cache_full_blocks`) failed before writing them."""
        blocks = self.req_blocks.get(request.request_id, [])
        first = request.num_computed_tokens // self.block_size
        for block in blocks[first:]:
            if block is not None and block is not self.null_block:
                self.pool.forget(block)
        if request.request_id in self._num_cached_blocks:
            self._num_cached_blocks[request.request_id] = min(
                self._num_cached_blocks[request.request_id], first)

    def free(self, request: Request) -> None:
        """Return a request's blocks to the pool, tail first (tails are evicted first)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_released.pop(request.request_id, None)
        self.pool.free([b for b in reversed(blocks) if b is not self.null_block])

    def held_from(self, request_id: str) -> int:
        """The first position whose block the request still holds (a window gives back the
        blocks behind it: their places in its table are placeholders)."""
        return self._num_released.get(request_id, 0) * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks
