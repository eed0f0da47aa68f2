"""Speculative decoding's engine-side pieces: the proposer interface, the proposer a config
asks for, and the counters behind `pkv:spec_decode_*` and `pkv bench`'s acceptance figures.

One step of a speculating request: the scheduler gives it KV slots for its token and up to k
drafts; a proposer fills them (ngram_proposer.py, draft_proposer.py beside this file); the
target runs all of them in the ordinary batch; the rejection sampler
(core/sample/rejection_sampler.py) keeps the accepted drafts and adds one token; the scheduler
rolls back the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pkv.core.config.engine import EngineConfig
from pkv.core.config.speculative import SpeculativeConfig
from pkv.core.sched.request import Request


class Proposer(Protocol):
    """Guesses up to lookahead[id] next tokens for each request; a proposer with a model
    holds `kv_bytes_per_block` of its own per KV block, allocated by `allocate_kv`."""

    kv_bytes_per_block: int

    def allocate_kv(self, num_blocks: int) -> None: ...

    def propose(self, requests: list[Request], lookahead: dict[str, int],
                tables: dict[str, list[list[int]]], high_watermark: int,
                held_from: dict[str, int] | None = None) -> dict[str, list[int]]:
        """`held_from`: the first position whose block each request's first table still
        holds (a windowed model gives back the blocks behind its window)."""


def build_proposer(config: EngineConfig, spec: SpeculativeConfig, max_model_len: int,
                   vocab_size: int, show_progress: bool) -> Proposer:
    """The proposer `spec` names (a draft model loads here)."""
    if spec.method == "ngram":
        from pkv.core.spec_decode.ngram_proposer import NgramProposer

        return NgramProposer(spec)
    from pkv.core.spec_decode.draft_proposer import DraftModelProposer

    return DraftModelProposer.load(config, spec, max_model_len, vocab_size, show_progress)


@dataclass
class SpecDecodeStats:
    """Drafts proposed and accepted since start, and how many were accepted per verify."""

    num_spec_tokens: int
    num_drafts: int = 0  # verifies (requests x steps that had drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # acceptance_lengths[a]: verifies that accepted exactly a drafts
    acceptance_lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.acceptance_lengths = [0] * (self.num_spec_tokens + 1)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.acceptance_lengths[num_accepted] += 1
