"""`pkv bench agreement`: how often a model with integer activations (`awq_activations`) or a
smaller KV cache (`kv_cache_dtype`) picks the same next token as with float32, position by
position. The float32 engine
decodes greedily; each prefix of its output then goes to the integer engine as a prompt for
one token (teacher forcing: one disagreement does not derail what follows), in steps no
longer than the integer GEMV takes, so that every token goes through it. The prefixes share
their blocks through the prefix cache, so this costs little more than one decode."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table


@dataclass
class Agreement:
    positions: int
    agreeing: int
    candidate: str  # what differs from the reference: activations, KV dtype

    @property
    def rate(self) -> float:
        return self.agreeing / self.positions if self.positions else 0.0


def text_prompts(tokenizer: Any, num_prompts: int, input_len: int) -> list[list[int]]:
    """The first `input_len` tokens of pkv's own source files (code and prose), one each: text
    a model continues as it would a user's, not random tokens."""
    root = Path(__file__).resolve().parents[2] / "core"  # cli/bench/ -> the package root
    prompts = []
    for path in sorted(root.rglob("*.py")):
        ids = tokenizer.encode(path.read_text(), add_special_tokens=False)[:input_len]
        if len(ids) == input_len:
            prompts.append(ids)
        if len(prompts) == num_prompts:
            return prompts
    raise ValueError(f"only {len(prompts)} source files hold {input_len} tokens")


def measure(reference: Any, candidate: Any, prompts: list[list[int]],
            output_len: int, candidate_label: str) -> Agreement:
    """Top-1 agreement of `candidate` with `reference`'s greedy tokens over every position."""
    from pkv.core.sample.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy)]
    prefixes = [prompt + out[:k] for prompt, out in zip(prompts, outputs)
                for k in range(len(out))]
    wanted = [t for out in outputs for t in out]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    got = [o.outputs[0].token_ids[0] for o in candidate.generate(prefixes, one)]
    return Agreement(len(wanted), sum(a == b for a, b in zip(got, wanted)),
                     candidate_label)


def agreement_table(result: Agreement) -> Table:
    table = Table(title="pkv bench agreement: next-token top-1, teacher-forced on float32's "
                        "greedy output")
    for column in ("candidate", "positions", "agreeing", "agreement"):
        table.add_column(column, justify="right")
    table.add_row(result.candidate, str(result.positions), str(result.agreeing),
                  f"{100 * result.rate:.2f}%")
    return table
