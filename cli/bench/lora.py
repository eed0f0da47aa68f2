"""`pkv bench lora`: the same prompts on the base model without LoRA, then on a LoRA engine
with no adapter and with adapters spread evenly over the batch, back to back; the share of a
step the adapters cost, and the memory each loaded adapter takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.table import Table

from pkv.cli.bench.workload import BenchResult, run_pkv


@dataclass
class LoRARun:
    """One batch size: base engine, LoRA engine without and with adapters."""

    batch: int
    num_adapters: int
    base: BenchResult
    lora_engine_base: BenchResult
    adapters: BenchResult

    @property
    def ratio(self) -> float:
        return self.adapters.output_tps / self.base.output_tps

    @property
    def lora_share(self) -> float:
        """Of a step with adapters, the part the adapters' products take."""
        return 1 - self.lora_engine_base.elapsed_s / self.adapters.elapsed_s

    def as_json(self) -> dict[str, Any]:
        return {"batch": self.batch, "adapters_in_batch": self.num_adapters,
                "base": self.base.as_json(), "lora_engine_base": self.lora_engine_base.as_json(),
                "with_adapters": self.adapters.as_json(), "ratio_vs_base": self.ratio,
                "lora_share_of_step": self.lora_share}


def run_batch(base: Any, lora: Any, requests: list[Any], prompts: list[list[int]],
              output_len: int, batch: int, profile: bool, rounds: int) -> LoRARun:
    """Base engine, the LoRA engine on base requests, then with the adapters spread
    round-robin (batch 1: the first adapter only); `rounds` times in turn, keeping each
    one's fastest run (the machine's slow spells hit one run, not a whole round)."""
    spread = requests if batch > 1 else requests[:1]
    per_prompt = [spread[i % len(spread)] for i in range(len(prompts))]
    best: list[BenchResult | None] = [None, None, None]
    for _ in range(rounds):
        runs = [run_pkv(base, prompts, output_len, batch),
                run_pkv(lora, prompts, output_len, batch),
                run_pkv(lora, prompts, output_len, batch, profile=profile,
                        lora_requests=per_prompt)]
        best = [r if b is None or r.output_tps > b.output_tps else b
                for r, b in zip(runs, best)]
    plain, no_adapter, with_adapters = best
    plain.name, no_adapter.name, with_adapters.name = ("base (no LoRA)", "LoRA engine, base",
                                                       f"{len(spread)} adapter(s)")
    return LoRARun(batch, len(spread), plain, no_adapter, with_adapters)


def lora_table(runs: list[LoRARun]) -> Table:
    table = Table(title="pkv bench lora: output tok/s")
    for column in ("batch", "adapters", "base (no LoRA)", "LoRA engine, no adapter",
                   "with adapters", "vs base", "adapters' share of a step"):
        table.add_column(column, justify="right")
    for r in runs:
        table.add_row(str(r.batch), str(r.num_adapters), f"{r.base.output_tps:.1f}",
                      f"{r.lora_engine_base.output_tps:.1f}", f"{r.adapters.output_tps:.1f}",
                      f"{r.ratio:.0%}", f"{r.lora_share:.0%}")
    return table


def memory_table(engine: Any) -> Table:
    """Per loaded adapter: its slot in every LoRA linear, and its own weights."""
    slot_bytes = sum(layer.nbytes_per_slot for layer in engine.runner.lora_layers.values())
    table = Table(title="memory per loaded adapter")
    for column in ("adapter", "rank", "weights (host copy)", "slot (all linears)"):
        table.add_column(column, justify="right")
    for name, adapter in engine.lora.adapters.items():
        table.add_row(name, str(adapter.rank), f"{adapter.nbytes / 2**20:.1f} MiB",
                      f"{slot_bytes / 2**20:.1f} MiB")
    return table
