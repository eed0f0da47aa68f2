"""How many KV blocks the pool gets: from `kv_cache_memory` (bytes) or `memory_utilization`
(of the device's memory), never fewer than one sequence of max_model_len needs at once, and
the same on every rank (the tightest rank's)."""

from __future__ import annotations

import os

import psutil
import torch
import torch.distributed as dist

from pkv.core.config.engine import EngineConfig
from pkv.core.layers.kv_groups import KVGroups
from pkv.core.sched.kv_cache_manager import cdiv


def blocks_per_seq(config: EngineConfig, groups: KVGroups, max_model_len: int) -> int:
    """The most blocks one sequence of max_model_len holds at once: all of them in a global
    group; in a windowed one, its window's and one step's chunk of tokens."""
    budget = config.token_budget(max_model_len)
    full = cdiv(max_model_len, config.block_size)
    return sum(full if g.window is None
               else min(full, cdiv(g.window + budget, config.block_size) + 1)
               for g in groups.groups)


def num_kv_blocks(config: EngineConfig, groups: KVGroups, per_block: int,
                  device: torch.device, max_model_len: int, distributed: bool) -> int:
    """The pool's blocks of `per_block` bytes each (every rank calls it at once when
    `distributed`); a one-line ValueError when they cannot hold one sequence."""
    per_seq = blocks_per_seq(config, groups, max_model_len)
    if per_block == 0:  # blocks that cost nothing: enough for every sequence at once
        return config.max_num_seqs * per_seq
    if config.kv_cache_memory is not None:
        budget = int(config.kv_cache_memory)
        total, _ = _device_memory(device)
        if budget > total:  # (a typo: 2TB for 2GB) refused here, not by a failed allocation
            raise ValueError(f"kv_cache_memory={budget} bytes is more than this {device.type} "
                             f"device's memory ({total / 2**30:.1f} GiB)")
        num_blocks = budget // per_block
        source = f"kv_cache_memory={budget} bytes"
    else:
        num_blocks = _blocks_from_utilization(config, device, per_block,
                                              _ranks_sharing(device) if distributed else 1)
        # More than every running sequence at full length could use is never needed.
        num_blocks = min(num_blocks, config.max_num_seqs * per_seq)
        source = f"memory_utilization={config.memory_utilization}"
    if distributed:  # one pool size for all ranks: what the tightest one holds
        counts = torch.tensor([num_blocks], dtype=torch.long)
        dist.all_reduce(counts, op=dist.ReduceOp.MIN)
        num_blocks = int(counts.item())
    if num_blocks < per_seq:
        raise ValueError(
            f"{source} gives {num_blocks} KV blocks of {config.block_size} tokens, fewer than "
            f"one sequence of max_model_len={max_model_len} needs ({per_seq}): raise "
            "kv_cache_memory or lower max_model_len")
    return num_blocks


def _device_memory(device: torch.device) -> tuple[int, int]:
    """(total, in use) bytes: the GPU's, or the machine's and this process's resident set."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, total - free
    return psutil.virtual_memory().total, psutil.Process().memory_info().rss


def _ranks_sharing(device: torch.device) -> int:
    """How many ranks share this rank's memory: a GPU is each rank's own; a host's RAM is
    shared by every rank on it (torchrun's LOCAL_WORLD_SIZE, else all: pkv starts its
    ranks on one machine)."""
    if device.type == "cuda":
        return 1
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else dist.get_world_size()


def _blocks_from_utilization(config: EngineConfig, device: torch.device, per_block: int,
                             ranks_sharing: int = 1) -> int:
    """The blocks this rank's share of memory_utilization holds after its own use."""
    total, used = _device_memory(device)
    return max(0, int(total * config.memory_utilization / ranks_sharing) - used) // per_block
