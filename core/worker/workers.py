"""Tensor-parallel worker processes: launch, lockstep steps, and a clean end.

The driver (rank 0) owns the scheduler; every step it broadcasts the flattened batch and all
ranks run the forward pass together. Workers are spawned by pkv (one machine) or by
`torchrun` (several machines; rank 0 serves HTTP). Lifecycle rules:

- a worker dies with its driver whatever kills it: the kernel's parent-death signal
  (Linux), and a thread that watches the parent pid elsewhere (tp_worker.py, the worker's
  side);
- a worker that dies is noticed by a monitor thread in the driver, which fails the engine
  with a clear error instead of letting the next step hang;
- the process group (and with it the rendezvous port) is torn down on shutdown.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pkv.core.distributed import objects
from pkv.core.layers.attention_backend import AttentionMetadata
from pkv.core.worker.kv_parts import KVTransfer

logger = logging.getLogger("pkv.workers")
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
PAYLOAD_ENV = "PKV_TP_WORKER"  # how WorkerGroup.start hands a worker its settings


@dataclass
class StepInputs:
    """Everything a rank needs for one forward pass, broadcast by the driver."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_idx: torch.Tensor
    high_watermark: int
    token_type_ids: torch.Tensor | None = None  # an encoder's segments (cross-encoder pairs)
    # Ranks with adapters (tensor-parallel peers, pipeline stages): (slot,
    # LoRAAdapter.weights) to load before the forward, and the step's runs of rows by slot.
    lora_loads: list[tuple[int, dict]] = field(default_factory=list)
    lora_segments: list[tuple[int, int, int]] = field(default_factory=list)
    # Pipeline stages: the pooling requests' rows, which the last stage sends back.
    pool_idx: torch.Tensor | None = None
    # The KV disk tier split over ranks: parts of blocks to give or take before the forward.
    kv: KVTransfer | None = None


def broadcast(obj: Any = None, group: Any = None) -> Any:
    """Rank 0 (of the world, or of `group`: its first rank) sends `obj`; every rank of the
    group returns it."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    sending = dist.get_rank() == src
    box = [objects.dumps(obj) if sending else None]  # (GPU tensors land on each rank's GPU)
    dist.broadcast_object_list(box, src=src, group=group)
    return obj if sending else objects.loads(box[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size(config_dict: dict[str, Any]) -> int:
    """Processes of one engine: tensor x pipeline parallel (EngineConfig.world_size)."""
    return config_dict["tensor_parallel_size"] * config_dict.get("pipeline_parallel_size", 1)


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def dist_backend(device: str) -> str:
    """The process group's backends for ranks computing on `device` (a resolved type, not
    `auto`): on GPUs NCCL for CUDA tensors and gloo for the CPU ones (the pool-size count,
    objects), which NCCL does not take."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def local_rank(rank: int) -> int:
    """This rank's place on its node: torchrun's LOCAL_RANK under torchrun; else (ranks pkv
    started itself, on one node) the rank, whatever LOCAL_RANK an outer launcher left in the
    environment every rank inherits."""
    return int(os.environ.get("LOCAL_RANK", rank)) if launched_by_torchrun() else rank


def use_local_gpu(device: str, rank: int) -> None:
    """Each rank on a node takes its own GPU (`local_rank`)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(local_rank(rank))


def share_cores(world: int) -> None:
    # Ranks on one machine split its cores; oversubscribed threads slow every rank down.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


class WorkerGroup:
    """The driver's handle on the other ranks."""

    def __init__(self, size: int, processes: list[subprocess.Popen],
                 threads_before: int, pipeline: bool = False) -> None:
        self.size = size  # ranks, the driver included
        self.pipeline = pipeline  # ranks are pipeline stages (else tensor-parallel shards)
        # How the driver tells pipeline stages to stop (the runner sets it: it knows them).
        self.stop_stages: Any = None
        self.processes = processes
        self._threads_before = threads_before
        self.error: str | None = None
        self._closing = False
        self._monitor = threading.Thread(target=self._watch, name="pkv-tp-monitor", daemon=True)
        self._monitor.start()

    @classmethod
    def start(cls, config_dict: dict[str, Any], device: str) -> WorkerGroup:
        """Start ranks 1..N-1 here (or join the group torchrun made), then rendezvous."""
        size = world_size(config_dict)
        if dist.is_initialized():  # (torch's own error named neither the engine nor a remedy)
            raise ValueError("another multi-rank engine runs in this process: shut it down "
                             "(LLM.shutdown()) before starting one with tensor or pipeline "
                             "parallelism")
        processes: list[subprocess.Popen] = []
        threads_before = torch.get_num_threads()
        if launched_by_torchrun():
            if int(os.environ["WORLD_SIZE"]) != size or os.environ["RANK"] != "0":
                raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes but "
                                 f"tensor x pipeline parallel size is {size}")
            init = "env://"
        else:
            init = f"tcp://127.0.0.1:{free_port()}"
            # A fresh interpreter per worker (not fork: OpenMP and threads do not survive it;
            # not multiprocessing's spawn: it re-runs the user's main module).
            payload = json.dumps({"size": size, "init": init, "parent": os.getpid(),
                                  "config": config_dict})
            for rank in range(1, size):
                processes.append(subprocess.Popen(
                    [sys.executable, "-m", "pkv.core.worker.tp_worker", str(rank)],
                    env={**os.environ, PAYLOAD_ENV: payload}))
            share_cores(size)
        use_local_gpu(device, 0)
        try:
            _rendezvous(device, init, size, processes)
        except BaseException:  # no worker left waiting, the driver's cores given back
            for proc in processes:
                proc.kill()
                proc.wait()
            torch.set_num_threads(threads_before)
            raise
        return cls(size, processes, threads_before,
                   config_dict.get("pipeline_parallel_size", 1) > 1)

    @property
    def threads_before(self) -> int:
        """The driver's threads before the ranks took their shares: all of them together."""
        return self._threads_before

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def _watch(self) -> None:
        while not self._closing:
            for rank, proc in enumerate(self.processes, start=1):
                code = proc.poll()
                if code is not None and not self._closing and self.error is None:
                    self.error = (f"worker rank {rank} (pid {proc.pid}) exited "
                                  f"with code {code}")
                    logger.error("%s; the engine stops", self.error)
            time.sleep(0.2)

    def check(self) -> None:
        """Raise if a worker has died (before the next step would wait for it forever)."""
        if self.error:
            raise RuntimeError(self.error)

    def explain(self, exc: BaseException) -> str:
        """A collective failed: name the worker that died if there is one (gloo only says
        "connection reset")."""
        deadline = time.monotonic() + 2.0
        while self.error is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.error or f"a tensor-parallel step failed: {exc}"

    def shutdown(self, force: bool = False) -> None:
        """Tell workers to exit (or kill them with `force`), reap them, and tear down the
        process group."""
        if self._closing:
            return
        self._closing = True
        if force:
            for proc in self.processes:
                proc.kill()
        elif self.error is None:
            try:
                if self.pipeline:  # stages wait on the previous one: a None step stops each
                    if self.stop_stages is not None:
                        self.stop_stages()
                else:
                    broadcast(None)
            except Exception:  # a dead peer: nothing left to tell
                pass
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads_before)  # the driver has its cores back


def _rendezvous(device: str, init: str, size: int, processes: list[subprocess.Popen]) -> None:
    """Join the process group as rank 0, failing fast if a worker dies while starting."""
    failure: list[BaseException] = []

    def join() -> None:
        try:
            dist.init_process_group(dist_backend(device), init_method=init, rank=0,
                                    world_size=size, timeout=COLLECTIVE_TIMEOUT)
        except BaseException as exc:  # reported by the waiting thread below
            failure.append(exc)

    thread = threading.Thread(target=join, name="pkv-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        for rank, proc in enumerate(processes, start=1):
            if proc.poll() is not None:
                for other in processes:
                    other.kill()
                raise RuntimeError(f"worker rank {rank} exited with code "
                                   f"{proc.returncode} while starting (its error is above)")
        thread.join(0.2)
    if failure:
        raise failure[0]
