"""`pkv bench compare`: two models (a 4-bit one and the float model it came from, say) on the
same prompts, in one process, in turn, round after round. A shared machine's fast and slow
spells move single runs by tens of percent; runs of the two models next to each other see the
same spell, so each round's ratio is sound where separate `pkv bench` runs are not."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from pkv.cli.bench.workload import run_pkv


@dataclass
class CompareRun:
    """One batch size: each round's output tok/s of the baseline and the candidate."""

    batch: int
    num_prompts: int
    baseline_tps: list[float] = field(default_factory=list)
    candidate_tps: list[float] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        """Candidate over baseline, round by round."""
        return [c / b for b, c in zip(self.baseline_tps, self.candidate_tps)]

    @property
    def median_ratio(self) -> float:
        return statistics.median(self.ratios)

    def as_json(self) -> dict[str, Any]:
        return {"batch": self.batch, "num_prompts": self.num_prompts,
                "baseline_output_throughput": self.baseline_tps,
                "candidate_output_throughput": self.candidate_tps,
                "ratios": self.ratios, "median_ratio": self.median_ratio}


def run_rounds(baseline: Any, candidate: Any, prompts: list[list[int]], output_len: int,
               batch: int, rounds: int) -> CompareRun:
    """`rounds` runs of each engine, alternating which goes first (A B, B A, ...), so that a
    drift in the machine's speed does not favour one of them."""
    pairs = alternate(lambda: run_pkv(baseline, prompts, output_len, batch),
                      lambda: run_pkv(candidate, prompts, output_len, batch), rounds)
    return CompareRun(batch, len(prompts), [a.output_tps for a, _ in pairs],
                      [b.output_tps for _, b in pairs])


def alternate(ours: Callable[[], Any], theirs: Callable[[], Any] | None,
              rounds: int) -> list[tuple[Any, Any]]:
    """`rounds` (pkv's result, the baseline's) pairs, alternating which runs first; without a
    baseline, pkv's runs alone (None beside each)."""
    pairs = []
    for r in range(rounds):
        if theirs is None:
            pairs.append((ours(), None))
        elif r % 2 == 0:
            mine = ours()
            pairs.append((mine, theirs()))
        else:
            other = theirs()
            pairs.append((ours(), other))
    return pairs


def median_round(pairs: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    """The round whose output tok/s ratio (pkv's alone without a baseline) is the median: a
    whole pair, so that its tables agree with the ratio quoted."""
    def key(pair: tuple[Any, Any]) -> float:
        mine, other = pair
        return mine.output_tps / other.output_tps if other is not None else mine.output_tps
    return sorted(pairs, key=key)[(len(pairs) - 1) // 2]


def compare_table(runs: list[CompareRun], baseline: str, candidate: str) -> Table:
    table = Table(title=f"pkv bench compare: output tok/s, median of rounds; "
                        f"A = {baseline}, B = {candidate}")
    for column in ("batch", "A", "B", "B / A (median)", "B / A per round"):
        table.add_column(column, justify="right")
    for r in runs:
        table.add_row(str(r.batch), f"{statistics.median(r.baseline_tps):.1f}",
                      f"{statistics.median(r.candidate_tps):.1f}", f"{r.median_ratio:.2f}x",
                      ", ".join(f"{x:.2f}" for x in r.ratios))
    return table
