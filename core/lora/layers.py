"""Batched LoRA on a linear layer: every row of a step with its own adapter, or none.

Adapters live in `max_loras` preallocated slots per linear, stacked and zero-padded to
`max_lora_rank` per fused shard, transposed for row-major products:

    a[slot]  [in, shards * max_rank]            (shard s uses columns s*R .. s*R + r)
    b[slot]  [shards * max_rank, out]           (its rows map to shard s's outputs only)

so q/k/v (or gate/up) of one adapter cost one product pair on the fused layer. A step's rows
come grouped by adapter (the scheduler orders requests so); each run of rows with one slot
adds `(x @ a[slot]) @ b[slot]` to the base output: two matrix products per run and linear,
whatever the batch size.

Under tensor parallelism a slot holds this rank's share of each pair: a column-parallel
linear's B rows for its output slice (A whole: every rank sees all of x), a row-parallel
linear's A columns for its input slice (B whole): its partial deltas join the layer's partial
outputs before the all-reduce that sums them, as (sum_r x_r A_r) B = x A B.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pkv.core.layers.linear import LinearSplit


@dataclass
class LoRABatch:
    """This step's runs of rows by adapter slot: (slot, first row, end row); shared by every
    LoRA linear of one model, set by the runner before each forward."""

    segments: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class LoRATarget:
    """What an adapter's pairs must fit on one linear: its input width and its fused
    outputs' widths, whole (a linear of this rank's or, under pipeline parallelism, of another
    stage's). A tensor-parallel rank knows where its slices end; the widest over the ranks
    (`merge_targets`) is the whole linear."""

    in_features: int
    out_sizes: tuple[int, ...]

    def widest(self, other: LoRATarget) -> LoRATarget:
        return LoRATarget(max(self.in_features, other.in_features),
                          tuple(max(a, b) for a, b in zip(self.out_sizes, other.out_sizes)))


def merge_targets(per_rank: list[dict[str, LoRATarget]]) -> dict[str, LoRATarget]:
    """Every rank's LoRA linears as one table: pipeline stages' paths side by side, the
    tensor-parallel slices of one linear as the whole of it."""
    merged: dict[str, LoRATarget] = {}
    for targets in per_rank:
        for path, target in targets.items():
            known = merged.get(path)
            merged[path] = target if known is None else known.widest(target)
    return merged


class LoRASlots:
    """One linear's adapter slots."""

    def __init__(self, in_features: int, out_sizes: list[int], max_loras: int, max_rank: int,
                 batch: LoRABatch, dtype: torch.dtype, device: torch.device,
                 split: LinearSplit | None = None) -> None:
        """`in_features`, `out_sizes`: this rank's (its `split`'s slices, if any)."""
        self.in_features = in_features
        self.out_sizes = out_sizes
        self.max_rank = max_rank
        self.batch = batch
        self.split = split
        width = len(out_sizes) * max_rank
        self.a = torch.zeros(max_loras, in_features, width, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, width, sum(out_sizes), dtype=dtype, device=device)

    def set(self, slot: int, weights: list) -> None:
        """Put an adapter's pairs (LoRAWeight: shard, a [r, in], b [out_shard, r], whole) in a
        slot; an empty list clears it."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for w in weights:
            a, b = self._rank_part(w.a, w.b, w.shard)
            r, col = a.shape[0], w.shard * self.max_rank
            start = sum(self.out_sizes[:w.shard])
            self.a[slot, :, col:col + r] = a.t()
            self.b[slot, col:col + r, start:start + self.out_sizes[w.shard]] = b.t()

    def _rank_part(self, a: torch.Tensor, b: torch.Tensor,
                   shard: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of a pair on fused shard `shard` (see the module docstring)."""
        if self.split is None:
            return a, b
        if self.split.kind == "column":
            start, count = self.split.slices[shard]
            return a, b[start:start + count]
        ((start, count),) = self.split.slices
        return a[:, start:start + count], b

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows] += x[rows] @ a[slot] @ b[slot] for each run of rows."""
        for slot, start, end in self.batch.segments:
            xs = x[start:end]
            y[start:end].addmm_(xs @ self.a[slot], self.b[slot])

    @property
    def target(self) -> LoRATarget:
        """The linear's widths as far as this rank's slices reach (all of them unsplit)."""
        if self.split is None:
            return LoRATarget(self.in_features, tuple(self.out_sizes))
        if self.split.kind == "column":
            return LoRATarget(self.in_features, tuple(s + n for s, n in self.split.slices))
        ((start, count),) = self.split.slices
        return LoRATarget(start + count, tuple(self.out_sizes))

    @property
    def nbytes_per_slot(self) -> int:
        return (self.a[0].numel() + self.b[0].numel()) * self.a.element_size()


def attach_lora(model: torch.nn.Module, max_loras: int, max_rank: int, batch: LoRABatch,
                dtype: torch.dtype, device: torch.device,
                first_layer: int = 0) -> dict[str, LoRASlots]:
    """Give every linear of the decoder layers adapter slots; returns them by module path
    (what adapters' target modules map to). `first_layer`: the model's first decoder layer
    is the whole model's layer `first_layer` (a pipeline stage's), and paths say so."""
    from pkv.core.layers.linear import Linear

    layers = {}
    for path, module in model.named_modules():
        if isinstance(module, Linear) and ".layers." in f".{path}":
            module.lora = LoRASlots(module.in_features, module.out_sizes, max_loras, max_rank,
                                    batch, dtype, device, module.split)
            layers[_renumbered(path, first_layer)] = module.lora
    return layers


def _renumbered(path: str, first_layer: int) -> str:
    """`...layers.<i>.rest` as `...layers.<i + first_layer>.rest`."""
    if not first_layer:
        return path
    head, sep, rest = f".{path}".partition(".layers.")
    index, dot, tail = rest.partition(".")
    return f"{head}{sep}{int(index) + first_layer}{dot}{tail}"[1:]


def lora_segments(slots_and_lengths: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Runs of consecutive rows with one adapter slot (-1: none), from each sequence's slot
    and row count in batch order."""
    segments: list[tuple[int, int, int]] = []
    start = 0
    for slot, n in slots_and_lengths:
        if slot >= 0:
            if segments and segments[-1][0] == slot and segments[-1][2] == start:
                segments[-1] = (slot, segments[-1][1], start + n)
            else:
                segments.append((slot, start, start + n))
        start += n
    return segments
