"""KV cache groups: layers that attend alike share a block table.

A hybrid model mixes global layers with sliding-window ones (Gemma 2 and 3, Qwen2 with
`max_window_layers`). A windowed layer only ever reads its last `window` keys, so its blocks
behind the window can go back to the pool while the global layers keep theirs. So layers are
grouped by their window, each group of at most `slots` layers (windowed layers fill as many
groups as they need), and every group has its own block table per request. One pool serves all
groups: a block id means `slots` layers' worth of K/V, and the cache tensor holds `slots`
layers, not all of them (layer i uses slot `slot_of[i]` of the blocks its group hands it):

    Gemma 3, 26 layers (every 6th global), window 512: 4 global layers, 22 windowed
      -> slots = 4; groups: [global: 5 11 17 23] [w: 0 1 2 3] [w: 4 6 7 8] ... [w: 24 25]
      a 4,096-token sequence holds 256 blocks for the global group and ~33 for each of the six
      windowed ones: 454 blocks of 4 layers, where one table for all 26 layers held 256 of 26.

A model whose layers all attend alike has one group of all its layers: one table.
Under pipeline parallelism the groups are the whole model's (the driver's block tables), and
each stage's blocks hold only its own layers of them (`KVGroups.for_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class KVGroup:
    """Layers sharing a block table, and the window they attend within (None: all keys)."""

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVGroup, ...]
    slots: int  # layers a block id holds: the largest group's size

    @cached_property
    def group_of(self) -> list[int]:
        """The group of each layer (built once: the runner hands it to every step)."""
        out = [0] * sum(len(g.layers) for g in self.groups)
        for gi, group in enumerate(self.groups):
            for layer in group.layers:
                out[layer] = gi
        return out

    @cached_property
    def slot_of(self) -> list[int]:
        """The cache slot of each layer (its place within its group)."""
        out = [0] * sum(len(g.layers) for g in self.groups)
        for group in self.groups:
            for slot, layer in enumerate(group.layers):
                out[layer] = slot
        return out

    @property
    def windows(self) -> list[int | None]:
        return [g.window for g in self.groups]

    def for_layers(self, layers: range) -> KVGroups:
        """The groups as a pipeline stage holding `layers` sees them: every group kept (the
        driver keeps one block table per group of the whole model), each with its layers
        among those, numbered from the stage's first; a block id holds the stage's largest
        share of one group (a stage's KV is its own layers' only)."""
        if layers == range(len(self.group_of)):
            return self
        groups = tuple(KVGroup(g.window, tuple(i - layers.start for i in g.layers
                                               if i in layers)) for g in self.groups)
        return KVGroups(groups, max(1, *(len(g.layers) for g in groups)))


def plan_kv_groups(layer_windows: list[int | None] | tuple[int | None, ...]) -> KVGroups:
    """Groups for layers with these windows (None: global attention).

    Layers with the same window form groups of `slots` layers, `slots` being the count of
    the rarest kind (a group's last one may be short). With one kind, one group."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) <= 1:
        window = layer_windows[0] if layer_windows else None
        return KVGroups((KVGroup(window, tuple(range(len(layer_windows)))),),
                        max(1, len(layer_windows)))
    slots = min(len(layers) for layers in kinds.values())
    # Global layers first: group 0 is the one a draft model or a full-length reader uses.
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    groups = [KVGroup(w, tuple(kinds[w][i:i + slots]))
              for w in order for i in range(0, len(kinds[w]), slots)]
    return KVGroups(tuple(groups), slots)
