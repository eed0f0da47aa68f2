"""The memory curve of a soak: where the warm-up ends, the slope after it, the peak.

A server's memory outside the KV pool climbs while its caches fill (oneDNN primitives per
batch shape, allocator arenas, grammar and tokenizer caches) and then holds; a leak keeps
climbing. Comparing two points cannot tell these apart; the curve can:

    MiB |       ______________________       plateau: from the first sample no later one
        |     _/                              rises more than `band` above
        |   _/                                slope: least squares over the plateau
        |__/                                  peak: the highest sample of the run
        +------------------------------ minutes

The run fails when no plateau starts in its first half, when the plateau's slope is above
`max_slope` MiB per minute, when the peak is above `max_peak` (where given), or when it rose
more than `max_warmup` MiB above the server's idle memory before any load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# A plateau: later samples all within this many MiB of its first one (minute-long samples of
# a small model; seconds-long ones, or a large model's arenas, need a wider band).
PLATEAU_BAND_MIB = 24.0
# The slope a healthy server may show after its plateau begins (allocator noise).
MAX_SLOPE_MIB_PER_MIN = 1.0
MIN_PLATEAU_SAMPLES = 3
# How far above its idle memory before any load a server may settle: the caches' bounds
# (README, Soak) plus allocator and library pages; SmolLM2's hour-long soak settled at +114.
MAX_WARMUP_MIB = 320.0


@dataclass
class MemoryCurve:
    """Memory outside the KV pool (MiB) sampled at idle, every `interval_min` minutes."""

    interval_min: float
    samples_mib: list[float] = field(default_factory=list)
    before_mib: float | None = None  # idle, before any load
    band_mib: float = PLATEAU_BAND_MIB

    def plateau_start(self) -> int | None:
        """Index of the first sample no later sample rises more than `band_mib` above, with
        at least MIN_PLATEAU_SAMPLES samples in the plateau; None if there is none. A fall is
        no leak (the heap handing pages back at idle lowers the curve)."""
        s = self.samples_mib
        for i in range(len(s) - MIN_PLATEAU_SAMPLES + 1):
            if max(s[i:]) - s[i] <= self.band_mib:
                return i
        return None

    def slope(self, start: int) -> float:
        """Least-squares slope (MiB per minute) of the samples from `start` on."""
        import numpy as np  # the CLI imports this module for its constants

        ys = np.asarray(self.samples_mib[start:], dtype=float)
        if len(ys) < 2:
            return 0.0
        xs = np.arange(len(ys)) * self.interval_min
        return float(np.polyfit(xs, ys, 1)[0])

    @property
    def peak(self) -> float:
        return max(self.samples_mib, default=0.0)

    @property
    def warmup(self) -> float | None:
        """How far the peak rose above memory before any load (None: no such sample)."""
        return None if self.before_mib is None else self.peak - self.before_mib

    def problems(self, max_slope: float = MAX_SLOPE_MIB_PER_MIN, max_peak: float | None = None,
                 max_warmup: float | None = None) -> list[str]:
        """What is wrong with the curve (empty: flat after a bounded warm-up)."""
        start = self.plateau_start()
        if start is None or start > len(self.samples_mib) // 2:
            return [f"memory outside the KV pool found no plateau in the first half of the run "
                    f"({self._describe()})"]
        problems = []
        slope = self.slope(start)
        if slope > max_slope:
            problems.append(f"memory outside the KV pool climbs {slope:.2f} MiB/min after its "
                            f"plateau (bound {max_slope:g})")
        if max_peak is not None and self.peak > max_peak:
            problems.append(f"memory outside the KV pool peaked at {self.peak:.0f} MiB, above "
                            f"the bound of {max_peak:.0f} MiB")
        warmup = self.warmup
        if max_warmup is not None and warmup is not None and warmup > max_warmup:
            problems.append(f"memory outside the KV pool rose {warmup:.0f} MiB above its idle "
                            f"{self.before_mib:.0f} MiB before load (bound {max_warmup:.0f})")
        return problems

    def _describe(self) -> str:
        s = [f"{v:.0f}" for v in self.samples_mib]
        return ", ".join(s if len(s) <= 12 else [*s[:6], "...", *s[-5:]]) + " MiB"


def plot_curve(path: Path, curve: MemoryCurve, total_mib: list[float]) -> None:
    """Memory over time: RSS and RSS outside the KV pool, the plateau's start and the memory
    before any load marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [(i + 1) * curve.interval_min for i in range(len(curve.samples_mib))]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(xs, total_mib, marker=".", label="RSS")
    ax.plot(xs, curve.samples_mib, marker=".", label="RSS outside the KV pool")
    start = curve.plateau_start()
    if start is not None:
        ax.axvline(xs[start], color="grey", linestyle="--",
                   label=f"plateau from minute {xs[start]:g}, "
                         f"{curve.slope(start):+.2f} MiB/min")
    if curve.before_mib is not None:
        ax.axhline(curve.before_mib, color="black", linewidth=0.8,
                   label=f"outside the KV pool before any load ({curve.before_mib:.0f} MiB)")
    ax.set(xlabel="minutes under load", ylabel="MiB (server idle at each sample)",
           title="pkv bench soak: server memory")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
