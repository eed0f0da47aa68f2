"""`pkv bench spec`: the same prompts with and without speculative decoding, back to back in
one process, per workload and batch size: throughput, the speed-up, how many drafts were
accepted, and whether the greedy texts are identical (they must be)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from pkv.cli.bench.workload import BenchResult, run_pkv


@dataclass
class SpecRun:
    """One workload at one batch size, without and with speculation."""

    workload: str
    plain: BenchResult
    spec: BenchResult

    @property
    def speedup(self) -> float:
        return self.spec.output_tps / self.plain.output_tps

    @property
    def num_identical(self) -> int:
        return sum(a == b for a, b in zip(self.plain.token_ids, self.spec.token_ids))

    def as_json(self) -> dict[str, Any]:
        return {"workload": self.workload, "batch": self.plain.batch,
                "plain": self.plain.as_json(), "speculative": self.spec.as_json(),
                "speedup": self.speedup, "identical_outputs": self.num_identical,
                "num_requests": len(self.plain.token_ids)}


def run_pair(plain: Any, spec: Any, workload: str, prompts: list[list[int]], output_len: int,
             batch: int, profile: bool) -> SpecRun:
    """Plain engine first, then the speculating one, on the same prompts."""
    a = run_pkv(plain, prompts, output_len, batch)
    b = run_pkv(spec, prompts, output_len, batch, profile=profile)
    a.name, b.name = "pkv", "pkv + speculation"
    return SpecRun(workload, a, b)


def spec_table(runs: list[SpecRun], config: str) -> Table:
    table = Table(title=f"pkv bench spec: {config}")
    for column in ("workload", "batch", "plain tok/s", "speculative tok/s", "speed-up",
                   "drafts accepted", "tokens per verify", "identical texts"):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for run in runs:
        s = run.spec
        table.add_row(run.workload, str(s.batch), f"{run.plain.output_tps:.1f}",
                      f"{s.output_tps:.1f}", f"{run.speedup:.2f}x",
                      f"{s.spec_acceptance_rate:.1%}" if s.spec_acceptance_rate is not None
                      else "- (no drafts)",
                      f"{s.spec_mean_accepted_len:.2f}" if s.spec_mean_accepted_len else "-",
                      f"{run.num_identical}/{len(s.token_ids)}")
    return table


def print_runs(console: Console, runs: list[SpecRun], config: str, profile: bool) -> None:
    from pkv.cli.bench import report

    console.print(spec_table(runs, config))
    if profile:
        console.print(report.profile_table([r.spec for r in runs]))
