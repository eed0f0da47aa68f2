"""Scheduling: `Request` (one sequence's state), the `Scheduler` (continuous batching,
chunked prefill, preemption), the `KVCacheCoordinator` over a `KVCacheManager` per KV group
and their shared `BlockPool` (paged blocks, prefix cache), the prefix cache's disk tier, the
thinking budget, and the cache inspector. May import lora, sample, config and below.
"""
