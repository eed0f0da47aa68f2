"""Scheduling: `Request` (one sequence's state), the `Scheduler` (continuous batching,
chunked prefill, preemption), the `KVCacheManager` and its `BlockPool` (paged blocks, prefix
cache), and the cache inspector. May import lora, sample, config and below.
"""
