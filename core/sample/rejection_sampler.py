"""RejectionSampler: decides which proposed (draft) tokens the target model accepts.

A speculating request brings m drafts d1..dm and m+1 rows of target logits: row j is the
target's distribution for the token after the drafts before it. Walking the rows in order:

- greedy: accept d(j+1) while it is the row's argmax; the first row that disagrees gives its
  argmax instead, and the walk stops. With every draft accepted, the last row adds one more.
- sampled (modified rejection sampling, Leviathan et al. 2023): every proposer here proposes
  one token per position (q is a point mass), so d is accepted with probability
  min(1, p(d)/q(d)) = p(d); on rejection the token is drawn from the normalized residual
  max(p - q, 0), which is p without d. The accepted-or-resampled token is then distributed
  exactly as p, so output follows the target's distribution whatever was proposed.

Each row's p comes from the same processing as plain sampling (penalties over the outputs and
the drafts before it, bans, temperature, top-k/p, min-p), and random draws come from the
request's own generator, so a seeded request stays reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pkv.core.sample.prompt_logprobs import LogprobEntry
from pkv.core.sample.sampler import Sampler, SamplingRow, draw


@dataclass(slots=True)
class VerifyOutput:
    """Per request: the tokens it gains this step (accepted drafts, then one from the
    target), their logprob entries (None where not asked), and how many drafts it had."""

    token_ids: list[list[int]]
    logprobs: list[list[LogprobEntry] | None]
    num_drafts: list[int]
    # by request id: the step's prompt rows' entries, for requests that ask prompt_logprobs
    prompt_logprobs: dict[str, list[LogprobEntry]] = field(default_factory=dict)


class RejectionSampler:
    """Verifies drafts against target logits, with the engine's Sampler for the processing."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 drafts: list[list[int]]) -> VerifyOutput:
        """`rows` and the logits' rows: len(d) + 1 consecutive rows per request's drafts d."""
        processed, raw = self.sampler.process(logits, rows)
        argmax = self.sampler.greedy(processed).tolist()
        probs = self._probs(processed, rows)
        chosen = list(argmax)
        tokens: list[list[int]] = []
        row = 0
        for ds in drafts:
            out = []
            for j in range(len(ds) + 1):
                proposed = ds[j] if j < len(ds) else None
                r = row + j
                token = (argmax[r] if r not in probs
                         else self._accept_or_draw(probs[r], proposed, rows[r]))
                chosen[r] = token
                out.append(token)
                if token != proposed:
                    break
            tokens.append(out)
            row += len(ds) + 1
        entries = self.sampler.logprobs(raw, torch.tensor(chosen, device=logits.device), rows)
        return VerifyOutput(tokens, self._group(entries, drafts, tokens),
                            [len(d) for d in drafts])

    def _probs(self, processed: torch.Tensor, rows: list[SamplingRow]) -> dict[int, torch.Tensor]:
        idx = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not idx:
            return {}
        probs = Sampler.filtered_probs(processed[idx], [rows[i].params for i in idx])
        return dict(zip(idx, probs))

    def _accept_or_draw(self, p: torch.Tensor, proposed: int | None, row: SamplingRow) -> int:
        generator = row.generator or self.sampler.generator
        p = p / p.sum()  # min-p leaves rows unnormalized
        if proposed is not None:
            u = torch.rand((), generator=generator, device=p.device)
            if float(u) < float(p[proposed]):
                return proposed
            p = p.clone()
            p[proposed] = 0
        return int(draw(p.unsqueeze(0), [generator])[0])

    @staticmethod
    def _group(entries: list[LogprobEntry | None], drafts: list[list[int]],
               tokens: list[list[int]]) -> list[list[LogprobEntry] | None]:
        out: list[list[LogprobEntry] | None] = []
        row = 0
        for ds, got in zip(drafts, tokens):
            first = entries[row]
            out.append(None if first is None
                       else [e for e in entries[row:row + len(got)] if e is not None])
            row += len(ds) + 1
        return out
