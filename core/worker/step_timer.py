"""StepTimer: where an engine step's wall time goes, phase by phase (`pkv bench --profile`).

The engine and the runner call `lap(phase)` at each phase boundary; a disabled timer returns
at once, so the hooks stay in the hot path for free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

# The phases of one step, in order; everything but `forward` is engine overhead.
# `propose` is a speculating step's drafting (a draft model's passes, or prompt lookup).
PHASES = ("schedule", "propose", "prepare_inputs", "forward", "sample", "outputs")


@dataclass
class StepTimer:
    """Accumulated seconds per phase over the steps timed since `reset`."""

    enabled: bool = False
    sync_cuda: bool = False  # CUDA work is asynchronous: wait for it at each lap
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    num_steps: int = 0
    _last: float = 0.0

    def start(self) -> None:
        if self.enabled:
            self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap (or `start`) to `phase`."""
        if not self.enabled:
            return
        if self.sync_cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.totals[phase] += now - self._last
        self._last = now

    def end_step(self) -> None:
        if self.enabled:
            self.lap("outputs")
            self.num_steps += 1

    def reset(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.num_steps = 0

    @property
    def total_s(self) -> float:
        return sum(self.totals.values())
