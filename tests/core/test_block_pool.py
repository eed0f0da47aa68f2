"""BlockPool and KVCacheManager as pure Python: allocation, ref counts, LRU, prefix hits."""

from __future__ import annotations

from pkv.core.sample.sampling_params import SamplingParams
from pkv.core.sched.block_pool import BlockPool
from pkv.core.sched.kv_cache_manager import KVCacheManager
from pkv.core.sched.request import Request, hash_block


def _request(rid: str, tokens: list[int], block_size: int = 4, salt: bytes = b"") -> Request:
    return Request(rid, tokens, SamplingParams(), frozenset({2}), block_size, cache_salt=salt)


def test_allocate_and_free_return_every_block():
    pool = BlockPool(8, enable_caching=False)
    blocks = pool.allocate(5)
    assert pool.num_free_blocks == 3 and all(b.ref_cnt == 1 for b in blocks)
    pool.free(blocks)
    assert pool.num_free_blocks == 8


def test_freed_uncached_blocks_are_reused_before_fresh_ones():
    pool = BlockPool(8, enable_caching=False)
    a = pool.allocate(2)
    pool.free(a)
    again = pool.allocate(2)
    assert {b.block_id for b in again} == {b.block_id for b in a}
    assert pool.high_watermark == 2


def test_cached_blocks_are_evicted_least_recently_used_first():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(4)
    key = lambda i: (None, (i,), b"")
    for i, b in enumerate(blocks):
        pool.cache(b, bytes([i]), key(i))
    pool.free([blocks[2]])  # freed first: least recently used
    pool.free([blocks[0]])
    taken = pool.allocate(1)[0]
    assert taken is blocks[2] and pool.lookup(bytes([2]), key(2)) is None
    assert pool.lookup(bytes([0]), key(0)) is blocks[0]  # still cached while free
    assert pool.num_evictions == 1
    # Blocks in use are never taken, whatever their age: only the free one is left to give.
    assert pool.allocate(1)[0] is blocks[0] and pool.num_free_blocks == 0
    assert pool.lookup(bytes([1]), key(1)) is blocks[1] and blocks[1].ref_cnt == 1


def test_an_eviction_callback_that_fails_leaves_the_pool_whole():
    # The disk tier saves each evicted block; a save that raises (no memory to stage it)
    # must not leave the block half evicted: in the hash map, out of the free queue.
    pool = BlockPool(2, enable_caching=True)
    block = pool.allocate(1)[0]
    pool.cache(block, b"h", (None, (1,), b""))
    pool.free([block])

    def fail(_: object) -> None:
        raise MemoryError("no pinned memory to stage the block")

    pool.on_evict = fail
    taken = pool.allocate(2)
    assert block in taken and pool.lookup(b"h", (None, (1,), b"")) is None
    pool.free(taken)
    assert pool.num_free_blocks == 2 and pool.num_cached_blocks == 0


def test_a_hash_hit_is_confirmed_by_its_key():
    pool = BlockPool(2, enable_caching=True)
    block = pool.allocate(1)[0]
    pool.cache(block, b"h", (None, (1, 2), b""))
    assert pool.lookup(b"h", (None, (1, 2), b"")) is block
    assert pool.lookup(b"h", (None, (1, 3), b"")) is None  # same hash, other tokens
    assert pool.lookup(b"h", (None, (1, 2), b"salt")) is None


def test_hash_chains_from_parent():
    h1 = hash_block(None, [1, 2, 3, 4])
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], b"tenant-a") != h1
    assert len(h1) == 32  # SHA-256


def test_prefix_hit_shares_blocks_and_leaves_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    a = _request("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    b = _request("b", list(range(10)) + [99])
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8 and [h.block_id for h in hits] == kv.block_ids("a")[:2]
    assert kv.allocate_slots(b, 3, hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert all(blk.ref_cnt == 2 for blk in hits)
    # A prompt that is exactly two full blocks reuses only one: its last token is recomputed.
    c = _request("c", list(range(8)))
    assert kv.get_computed_blocks(c)[1] == 4


def test_salt_separates_tenants():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    a = _request("a", list(range(9)), salt=b"x")
    assert kv.allocate_slots(a, 9)
    assert kv.get_computed_blocks(_request("b", list(range(9)), salt=b"y"))[1] == 0
    assert kv.get_computed_blocks(_request("c", list(range(9)), salt=b"x"))[1] == 8


def test_allocation_fails_cleanly_when_out_of_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=False)
    a = _request("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    b = _request("b", list(range(8)))
    assert not kv.allocate_slots(b, 8)
    assert kv.block_ids("b") == [] and kv.pool.num_free_blocks == 1
    kv.free(a)
    assert kv.pool.num_free_blocks == 3


def test_freed_request_tail_is_evicted_before_its_head():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=True)
    a = _request("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    head, _, tail = kv.block_ids("a")
    kv.free(a)
    assert kv.pool.allocate(1)[0].block_id == tail
    assert kv.pool.lookup(a.block_hashes[0], a.block_key(0)).block_id == head
