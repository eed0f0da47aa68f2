"""A worker rank's process (tensor-parallel shard or pipeline stage): die with the driver,
join the process group, load this rank's part, then run the forward passes the driver
broadcasts (and give or take its parts of KV blocks for the disk tier) until told to stop.

Started by `WorkerGroup.start` (`python -m pkv.core.worker.tp_worker RANK`, settings in the
environment) or, for ranks other than 0, by `pkv serve` under torchrun.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from pkv.core.config.engine import EngineConfig
from pkv.core.worker.kv_parts import KVTransfer
from pkv.core.worker.model_runner import ModelRunner
from pkv.core.worker.model_setup import ModelSetup, parallel_groups, resolve_device
from pkv.core.worker.pipeline_runner import PipelineModelRunner, runner_class
from pkv.core.worker.workers import (COLLECTIVE_TIMEOUT, PAYLOAD_ENV, StepInputs, broadcast,
                                     dist_backend, share_cores, use_local_gpu, world_size)

def _die_with_parent(parent_pid: int) -> None:
    # A watcher, not prctl's PDEATHSIG: that fires when the *thread* that started the
    # worker ends (an LLM built on a thread that then returns lost its ranks at once).
    if os.getppid() != parent_pid:  # the parent died already
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="pkv-parent-watch", daemon=True).start()


def build_runner(config: EngineConfig, rank: int) -> ModelRunner:
    """A worker rank's runner (the driver's is built by the engine)."""
    setup = ModelSetup.prepare(config)
    tp, stage = parallel_groups(config, setup.source.config, rank)
    return runner_class(stage)(config, setup, show_progress=False, tp=tp, stage=stage)


def serve(runner: ModelRunner, message: StepInputs | KVTransfer) -> None:
    """One message from the driver: a step, or (the KV disk tier, between steps) this
    rank's parts of blocks to give."""
    if isinstance(message, StepInputs):
        runner.run_step(message)
        return
    if runner.kv_parts is None:
        raise RuntimeError(f"{type(message).__name__} reached a rank without a KV disk tier")
    for sent in runner.kv_parts.serve(message):
        sent.wait()


def worker_main(rank: int, size: int, init: str, config_dict: dict[str, Any],
                parent_pid: int | None) -> None:
    """A worker rank: load its shard, then run forward passes until told to stop."""
    if parent_pid is not None:
        _die_with_parent(parent_pid)
        share_cores(size)
    config = EngineConfig.from_dict(config_dict)
    # The device resolved as the driver resolves it (`auto` is the GPU where there is one):
    # the ranks' backends must agree.
    device = resolve_device(config.device).type
    use_local_gpu(device, rank)
    dist.init_process_group(dist_backend(device), init_method=init, rank=rank,
                            world_size=size, timeout=COLLECTIVE_TIMEOUT)
    try:
        runner = build_runner(config, rank)
        if isinstance(runner, PipelineModelRunner):
            runner.serve_stage()
        else:
            while (message := broadcast()) is not None:
                serve(runner, message)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def torchrun_worker(config_dict: dict[str, Any]) -> None:
    """Ranks other than 0 under torchrun: the same loop, the group from the environment."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if size != world_size(config_dict):
        raise ValueError(f"torchrun started {size} processes but tensor x pipeline parallel "
                         f"size is {world_size(config_dict)}")
    worker_main(rank, size, "env://", config_dict, None)


def _main() -> None:
    """Entry of a worker that WorkerGroup.start began (the module docstring says how)."""
    payload = json.loads(os.environ.pop(PAYLOAD_ENV))
    try:
        worker_main(int(sys.argv[1]), payload["size"], payload["init"], payload["config"],
                    payload["parent"])
    except Exception as exc:  # one line for the driver's terminal, then a failing exit
        print(f"pkv worker rank {sys.argv[1]}: error: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    _main()
