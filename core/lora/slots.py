"""LoRASlotTable: which adapter sits in which of the `max_loras` slots, and who uses it.

The scheduler admits a request with an adapter only when the adapter holds a slot: already
resident, a free slot, or the least recently used slot no running request pins (evicted).
Running requests pin their adapter's slot until they finish or are preempted, so a slot is
never overwritten under a request that reads it.
"""

from __future__ import annotations

from collections import OrderedDict


class LoRASlotTable:
    """Slot assignment with pin counts and LRU eviction; pure bookkeeping (the runner copies
    the weights of newly assigned adapters into the slots)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slots: OrderedDict[int, int] = OrderedDict()  # adapter uid -> slot, LRU first
        self._pins: dict[int, int] = {}

    def acquire(self, key: int) -> tuple[int, bool] | None:
        """Pin adapter `key` (a load's uid) into a slot: (slot, whether its weights must
        be loaded), or None when every slot is pinned by other adapters."""
        if key in self._slots:
            self._slots.move_to_end(key)
            self._pins[key] = self._pins.get(key, 0) + 1
            return self._slots[key], False
        slot = self._free_slot()
        if slot is None:
            return None
        self._slots[key] = slot
        self._pins[key] = 1
        return slot, True

    def _free_slot(self) -> int | None:
        used = set(self._slots.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        for key in self._slots:  # least recently used first
            if not self._pins.get(key):
                slot = self._slots.pop(key)
                self._pins.pop(key, None)
                return slot
        return None

    def pins(self, key: int) -> int:
        """How many running requests pin adapter `key`."""
        return self._pins.get(key, 0)

    def release(self, key: int) -> None:
        """Unpin once (a request with this adapter finished or was preempted)."""
        if self._pins.get(key):
            self._pins[key] -= 1

    def unassign(self, key: int) -> None:
        """Free an unpinned adapter's slot whose weights were never loaded (its acquire's
        request did not start): the next acquire loads it again."""
        if not self._pins.get(key):
            self._slots.pop(key, None)
            self._pins.pop(key, None)
