"""A snapshot of the KV cache for operators: pool counts, hit rate, block tables, block map.

Taken on the engine thread between steps, so it is consistent; serializable to JSON for the
server's admin endpoint and rendered by `pkv inspect-cache`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# One character per block in `block_map`.
FREE, CACHED, USED, SHARED = ".", "c", "u", "s"


@dataclass(slots=True)
class RequestBlocks:
    request_id: str
    num_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    shared: list[bool]  # per block: held by more than one request


@dataclass(slots=True)
class CacheSnapshot:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    used: int
    cached_free: int
    free: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    evictions: int
    preemptions: int
    slots_allocated: int  # used blocks x block size
    tokens_stored: int  # slots holding a computed token (a shared block counts once)
    requests: list[RequestBlocks]
    block_map: str
    kv_cache_dtype: str = "float32"  # how K/V rows are stored (core/layers/kv_format.py)

    @property
    def hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def fragmentation(self) -> float:
        return 1 - self.tokens_stored / self.slots_allocated if self.slots_allocated else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate, "fragmentation": self.fragmentation}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheSnapshot:
        data = {k: v for k, v in data.items() if k not in ("hit_rate", "fragmentation")}
        data["requests"] = [RequestBlocks(**r) for r in data["requests"]]
        return cls(**data)


def filled_slots(engine: Any) -> int:
    """Slots of in-use blocks that hold a computed token, each shared block counted once."""
    bs = engine.kv_cache.block_size
    filled: dict[int, int] = {}
    for request in engine.scheduler.running:
        for group in engine.kv_cache.groups:
            for i, block in enumerate(group.req_blocks.get(request.request_id, [])):
                if block is group.null_block:  # given back behind a window
                    continue
                n = min(bs, max(0, request.num_computed_tokens - i * bs))
                filled[block.block_id] = max(filled.get(block.block_id, 0), n)
    return sum(filled.values())


def take_snapshot(engine: Any) -> CacheSnapshot:
    """Read the engine's cache state (call between steps, on the engine's thread)."""
    kv, pool = engine.kv_cache, engine.kv_cache.pool
    requests = []
    for request in engine.scheduler.running:
        blocks = [b for g in kv.groups for b in g.req_blocks.get(request.request_id, [])
                  if b is not g.null_block]
        requests.append(RequestBlocks(request.request_id, request.num_tokens,
                                      request.num_computed_tokens, [b.block_id for b in blocks],
                                      [b.ref_cnt > 1 for b in blocks]))
    chars = []
    for block in pool.blocks:
        if block.ref_cnt > 1:
            chars.append(SHARED)
        elif block.ref_cnt == 1:
            chars.append(USED)
        else:
            chars.append(CACHED if block.block_hash is not None else FREE)
    used = pool.num_used_blocks
    cached_free = sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
    return CacheSnapshot(
        num_blocks=pool.num_blocks, block_size=kv.block_size,
        bytes_per_block=engine.kv_bytes_per_block, used=used, cached_free=cached_free,
        free=pool.num_free_blocks - cached_free, prefix_cache_queries=kv.prefix_queries,
        prefix_cache_hits=kv.prefix_hits, evictions=pool.num_evictions,
        preemptions=engine.scheduler.num_preemptions, slots_allocated=used * kv.block_size,
        tokens_stored=filled_slots(engine), requests=requests, block_map="".join(chars),
        kv_cache_dtype=engine.runner.kv_format.name)
