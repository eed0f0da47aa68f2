"""The engine's side of the KV disk tier (`kv_offload_dir`, core/sched/kv_offload.py): the
store, keyed by everything that decides the bytes of a KV block, and what a step moves
between the disk, the pool and the other ranks (core/worker/kv_parts.py): blocks read from
disk go into the pool before the step's forward, and the other ranks' parts of blocks evicted
while it was scheduled come back with its results."""

from __future__ import annotations

import logging
import math

from pkv.core.config.engine import EngineConfig
from pkv.core.sched.kv_cache_coordinator import KVCacheCoordinator
from pkv.core.sched.kv_cache_manager import cdiv
from pkv.core.sched.kv_offload import KVOffloadStore, block_ids, model_fingerprint
from pkv.core.sched.kv_offload_files import smallest_file
from pkv.core.version import pkv_version
from pkv.core.worker.kv_parts import KVTransfer, KVWork
from pkv.core.worker.model_runner import ModelRunner
from pkv.core.worker.model_setup import ModelSetup

logger = logging.getLogger("pkv.engine")


def open_offload_store(config: EngineConfig, setup: ModelSetup, runner: ModelRunner,
                       max_num_batched_tokens: int) -> KVOffloadStore:
    """The disk tier of `config.kv_offload_dir` for this model, its dtypes and its split."""
    kv = runner.kv_cache
    layout = {
        "hf_config": setup.source.hf_config, "dtype": str(runner.dtype),
        "kv_dtype": str(kv.dtype), "kv_format": runner.kv_format.name,
        "kv_block_shape": [*kv.shape[:2], *kv.shape[3:]],
        "quantization": setup.loader.name if setup.loader else None,
        "awq_activations": config.awq_activations, "gguf_file": config.gguf_file,
        "revision": config.revision, "device": runner.device.type,
        "pkv": pkv_version(),
    }
    block_bytes = math.prod(layout["kv_block_shape"]) * kv.element_size()
    if runner.kv_parts is not None:  # a file holds every rank's part (heads, layers)
        layout["kv_parts"] = runner.kv_parts.sizes
        layout["parallel"] = [config.tensor_parallel_size, config.pipeline_parallel_size]
        # Which layers a stage holds: two splits can give every stage as many bytes
        layout["pp_layer_partition"] = config.pp_layer_partition
        block_bytes += runner.kv_parts.remote_bytes
    fingerprint = model_fingerprint(setup.source.path, layout)
    smallest = smallest_file(fingerprint, config.block_size, block_bytes)
    if int(config.kv_offload_size) < smallest:
        raise ValueError(f"kv_offload_size ({int(config.kv_offload_size)} bytes) holds no KV "
                         f"block of this model ({smallest} bytes a file: {block_bytes} of K/V "
                         "and the block's key)")
    # A step's allocations can evict a whole batch of blocks at once, in every KV group;
    # stage two steps' (in bytes about two steps of tokens over all layers, whatever the groups).
    per_step = cdiv(max_num_batched_tokens, config.block_size) * len(runner.kv_groups.groups)
    max_pending = max(64, 2 * per_step)
    store = KVOffloadStore(str(config.kv_offload_dir), int(config.kv_offload_size),
                           fingerprint,
                           lambda: runner.kv_cache, max_pending, runner.kv_parts)
    logger.info("KV disk tier: %s (%d blocks indexed, %.1f MiB of %.1f MiB)",
                config.kv_offload_dir, store.stats.files, store.stats.bytes_used / 2**20,
                int(config.kv_offload_size) / 2**20)
    return store


def step_kv_work(store: KVOffloadStore | None, kv_cache: KVCacheCoordinator,
                 runner: ModelRunner) -> KVWork | None:
    """The disk tier's share of the step about to run: blocks read from disk copied into the
    pool (split over ranks, the driver's part), and what the other ranks' parts do with the
    step (None: nothing)."""
    if store is None:
        return None
    loads = kv_cache.take_loads()
    if loads:  # prefix blocks read from disk, before the forward reads them
        runner.load_kv_blocks(loads, kv_cache.pool.high_watermark)
        runner.timer.lap("prepare_inputs")  # (the blocks are the step's inputs)
    if runner.kv_parts is None:
        return None
    due = store.hand_over()  # evicted while scheduling: their other parts
    if not (due or loads):
        return None
    return KVWork(KVTransfer(block_ids(due), [b for b, _ in loads]),
                  [data for _, data in loads], due)


def finish_kv_work(store: KVOffloadStore | None, kv: KVWork | None) -> None:
    """The evicted blocks' writes, now whole (their other parts came with the step)."""
    if store is not None and kv is not None and kv.due:
        store.finish(kv.due, kv.parts)


