"""Pipeline parallelism on torch.distributed: which layers each stage holds, and how a step's
hidden states travel from stage to stage.

Stage k holds layers [start, end): the first also the embedding and the LM head (a tied head
is the embedding: held once), the last the final norm. Every rank gets the step's inputs
(positions, block tables) from the driver; the first stage embeds and runs its layers, sends
(hidden, residual) to the next, and so on; the last sends the final hidden states of the rows
that sample back to the driver (rank 0, the first stage), which computes their logits and
samples. One send per stage boundary per step, where tensor parallelism all-reduces every
layer.

The step's inputs travel down the pipeline too (each stage passes them on), point to point
and without waiting, so the driver can start the next micro-batch on its own layers while
later stages still run the previous one (core/engine/llm_engine.py keeps P in flight).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pkv.core.distributed import objects


@dataclass(frozen=True)
class PipelineStage:
    """This process's stage: its index of `size` and its layers [start, end). With tensor
    parallelism inside stages, a stage is `width` ranks (world ranks stage * width + member)
    and member m of one stage talks to member m of the next."""

    rank: int = 0
    size: int = 1
    start: int = 0
    end: int | None = None  # None: to the last layer (one stage holds them all)
    width: int = 1
    member: int = 0
    # The group a step's pickled inputs travel in: None for the default (gloo); a gloo
    # group of all ranks where the default is NCCL, which sends GPU tensors only.
    objects: Any = field(default=None, compare=False)

    def world(self, stage: int, member: int | None = None) -> int:
        """The world rank of `member` (default: this one's) of `stage`."""
        return stage * self.width + (self.member if member is None else member)

    @property
    def next(self) -> int:
        return self.world(self.rank + 1)

    @property
    def prev(self) -> int:
        return self.world(self.rank - 1)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, num_layers: int) -> range:
        return range(self.start, num_layers if self.end is None else self.end)

    def send_next(self, tensors: tuple[torch.Tensor, ...]) -> list[Sent]:
        """The step's (hidden, residual) to the next stage, without waiting."""
        sent = []
        for t in tensors:
            t = t.contiguous()
            sent.append(Sent(dist.isend(t, self.next), t))
        return sent

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  count: int = 2) -> tuple[torch.Tensor, ...]:
        """The previous stage's (hidden, residual) of this step."""
        out = tuple(torch.empty(shape, dtype=dtype, device=device) for _ in range(count))
        for t in out:
            dist.recv(t, self.prev)
        return out

    def send_rows(self, rows: torch.Tensor) -> list[Sent]:
        """The last stage's final hidden states of the sampling rows, to the driver (member
        m to the first stage's member m, whose share of the LM head they feed)."""
        rows = rows.contiguous()
        return [Sent(dist.isend(rows, self.world(0)), rows)]

    def recv_rows(self, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
        rows = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(rows, self.world(self.size - 1))
        return rows


def partition_layers(num_layers: int, stages: int, spec: str | None = None,
                     layer_bytes: float = 1.0, first_extra: float = 0.0,
                     last_extra: float = 0.0) -> list[int]:
    """Layers per stage: `spec` ("10,12") as given, or contiguous runs that make the largest
    stage's bytes (its layers, plus the embedding on the first and the head on the last)
    as small as they can be."""
    if stages > num_layers:
        raise ValueError(f"pipeline_parallel_size={stages} exceeds the model's {num_layers} "
                         "layers: each stage needs at least one")
    if spec is not None:
        try:
            counts = [int(part) for part in spec.split(",")]
        except ValueError:
            raise ValueError(f"pp_layer_partition must be comma-separated integers, got "
                             f"{spec!r}") from None
        if len(counts) != stages or min(counts) < 1 or sum(counts) != num_layers:
            raise ValueError(f"pp_layer_partition={spec} must give {stages} stages of >= 1 "
                             f"layer summing to the model's {num_layers}")
        return counts
    return _balanced(num_layers, stages, layer_bytes, first_extra, last_extra)


def _balanced(num_layers: int, stages: int, layer_bytes: float, first_extra: float,
              last_extra: float) -> list[int]:
    """Dynamic programming over (stages used, layers placed): the least largest-stage cost
    of placing the first i layers on the first k stages."""
    def cost(k: int, n: int) -> float:
        return (n * layer_bytes + (first_extra if k == 0 else 0.0)
                + (last_extra if k == stages - 1 else 0.0))

    inf = float("inf")
    # best[k][i]: (cost, layers of stage k) placing layers [0, i) on stages 0..k
    best = [[(inf, 0)] * (num_layers + 1) for _ in range(stages)]
    for i in range(1, num_layers + 1):
        best[0][i] = (cost(0, i), i)
    for k in range(1, stages):
        for i in range(k + 1, num_layers + 1):
            best[k][i] = min((max(best[k - 1][i - n][0], cost(k, n)), n)
                             for n in range(1, i - k + 1))
    counts, i = [], num_layers
    for k in range(stages - 1, -1, -1):
        n = best[k][i][1]
        counts.append(n)
        i -= n
    return counts[::-1]


def stage_of(rank: int, counts: list[int], width: int = 1, member: int = 0) -> PipelineStage:
    start = sum(counts[:rank])
    return PipelineStage(rank, len(counts), start, start + counts[rank], width, member)


def send_object(obj: object, dst: int, group: Any = None) -> list[Sent]:
    """A step's inputs (or None: stop) to another rank without waiting: its pickled bytes'
    length, then the bytes (CPU tensors: `group` must be a gloo one). The caller keeps the
    returned works until they are done."""
    data = torch.frombuffer(bytearray(objects.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    return [Sent(dist.isend(size, dst, group=group), size),
            Sent(dist.isend(data, dst, group=group), data)]


def recv_object(src: int, group: Any = None) -> object:
    size = torch.empty(1, dtype=torch.long)
    dist.recv(size, src, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src, group=group)
    return objects.loads(data.numpy().tobytes())


def object_group() -> Any:
    """The group for pickled objects between stages: None (the default group) under gloo, a
    gloo group of every rank under NCCL. Every rank calls it, in the same order as its
    other groups."""
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


class Sent:
    """A send in flight and the tensor it reads (which must live until it is done)."""

    def __init__(self, work: dist.Work, tensor: torch.Tensor) -> None:
        self.work, self.tensor = work, tensor

    def wait(self) -> None:
        self.work.wait()
