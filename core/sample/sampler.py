"""Sampler: turns a batch of logits into one token per row, on tensors, per-row parameters.

Order, vLLM's: logit bias -> penalties -> bans (min_tokens, bad words) -> allowed tokens ->
(greedy rows: argmax) -> temperature -> min-p -> top-k -> top-p (over what min-p kept) ->
sample. Sampling inverts each row's cumulative distribution at one uniform
draw (`draw`), so a row with its own seed draws from its own generator and its result does
not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pkv.core.sample.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    banned_token_ids: list[int]  # stop/eos tokens under min_tokens; a bad word's next token
    allowed_mask: torch.Tensor | None = None  # [vocab] bool: guided decoding's allowed tokens
    # The token a thinking budget writes in place of the sampled one: its logprob is reported
    forced_token: int | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # per row: (top-k ids, top-k logprobs, sampled token logprob, sampled token rank) or None
    logprobs: list[tuple[list[int], list[float], float, int] | None]


class Sampler:
    """Batched sampling with per-request parameters."""

    def __init__(self, generator: torch.Generator,
                 first_argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`first_argmax`: the CPU kernels' argmax over the rows of contiguous float32 logits
        (csrc/sampling_cpu.cpp, 6x torch's at 256 x 49152); None: torch's."""
        self.generator = generator  # for rows without their own seed
        self.first_argmax = first_argmax

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        logits, raw_logprobs = self.process(logits, rows)
        token_ids = self._sample(logits, rows)
        return SamplerOutput(token_ids.tolist(), self.logprobs(raw_logprobs, token_ids, rows))

    def process(self, logits: torch.Tensor, rows: list[SamplingRow]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's logits after penalties, bias, bans and the guided mask; and the raw
        log-probabilities where any row asked for logprobs."""
        logits = logits.float()
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        self._apply_bias(logits, rows)  # before the penalties, as vLLM's
        logits = self._apply_penalties(logits, rows)
        self._apply_bans(logits, rows)
        self._apply_allowed(logits, rows)
        return logits, raw_logprobs

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if not idx:
            return logits
        vocab = logits.shape[1]
        sub = logits[idx]
        out_counts = _token_counts([rows[i].output_token_ids for i in idx], vocab, logits.device)
        prompt_seen = _token_counts([rows[i].prompt_token_ids for i in idx], vocab,
                                    logits.device) > 0
        param = lambda name: torch.tensor([getattr(rows[i].params, name) for i in idx],
                                          device=logits.device).unsqueeze(1)
        # Repetition (HF/vLLM): over prompt and output; divide positive logits, multiply negative.
        rep = param("repetition_penalty")
        seen = prompt_seen | (out_counts > 0)
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
        # Frequency and presence (OpenAI): over generated tokens only.
        sub = sub - param("frequency_penalty") * out_counts
        sub = sub - param("presence_penalty") * (out_counts > 0).float()
        logits = logits.clone()
        logits[idx] = sub
        return logits

    @staticmethod
    def _apply_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        for i, row in enumerate(rows):
            if row.params.logit_bias:
                ids = torch.tensor(list(row.params.logit_bias), device=logits.device)
                bias = torch.tensor(list(row.params.logit_bias.values()), device=logits.device)
                logits[i, ids] += bias.to(logits.dtype)

    @staticmethod
    def _apply_bans(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        for i, row in enumerate(rows):
            if row.banned_token_ids:
                logits[i, row.banned_token_ids] = float("-inf")

    @staticmethod
    def _apply_allowed(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Only the allowed tokens stay: a row's allowed_token_ids, then guided decoding's
        mask (after the bans: a token both allowed and banned stays banned)."""
        for i, row in enumerate(rows):
            if row.params.allowed_token_ids:
                kept = logits[i, row.params.allowed_token_ids].clone()
                logits[i] = float("-inf")
                logits[i, row.params.allowed_token_ids] = kept
        idx = [i for i, r in enumerate(rows) if r.allowed_mask is not None]
        if idx:
            allowed = torch.stack([rows[i].allowed_mask for i in idx]).to(logits.device)
            logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        random_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_idx:
            return self.greedy(logits)
        sub_rows = [rows[i] for i in random_idx]
        generators = [r.generator or self.generator for r in sub_rows]
        if len(random_idx) == len(rows):  # no copy of the rows, no argmax to throw away
            return draw(self.filtered_probs(logits, [r.params for r in rows]), generators)
        tokens = self.greedy(logits)
        probs = self.filtered_probs(logits[random_idx], [r.params for r in sub_rows])
        tokens[random_idx] = draw(probs, generators)
        return tokens

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax: the first maximum, a NaN above everything."""
        if (self.first_argmax is not None and logits.device.type == "cpu"
                and logits.dtype == torch.float32 and logits.is_contiguous()):
            return self.first_argmax(logits)
        # max's indices are argmax's, ~1.7x faster on CPU
        return logits.max(dim=-1).indices

    @staticmethod
    def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Probabilities after temperature, min-p, top-k and top-p."""
        device = logits.device
        temp = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        logits = logits / temp
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        if bool((min_p > 0).any()):  # p < min_p * p_max, in logits (log 0 = -inf: off)
            floor = logits.max(dim=-1, keepdim=True).values + torch.log(min_p)
            logits = logits.masked_fill(logits < floor, float("-inf"))
        # A top_k past the vocabulary keeps every token; clamped here, as one past int64 would
        # not fit the tensor and fail the whole step.
        vocab = logits.shape[-1]
        top_k = torch.tensor([min(p.top_k, vocab) for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        if bool((top_k > 0).any()) or bool((top_p < 1).any()):
            logits = _top_k_top_p(logits, top_k, top_p)
        return torch.softmax(logits, dim=-1)

    @staticmethod
    def logprobs(raw: torch.Tensor | None, token_ids: torch.Tensor,
                 rows: list[SamplingRow]) -> list[tuple[list[int], list[float], float, int] | None]:
        """Per row: its top logprobs and the chosen token's logprob and rank (None where the
        row did not ask)."""
        if raw is None:
            return [None] * len(rows)
        k = max(r.params.logprobs or 0 for r in rows)
        top_vals, top_ids = raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
        forced = [(i, r.forced_token) for i, r in enumerate(rows) if r.forced_token is not None]
        if forced:
            token_ids = token_ids.clone()
            for i, token in forced:
                token_ids[i] = token
        chosen = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        ranks = (raw > chosen.unsqueeze(1)).sum(dim=-1) + 1
        out: list[tuple[list[int], list[float], float, int] | None] = []
        for i, row in enumerate(rows):
            n = row.params.logprobs
            if n is None:
                out.append(None)
                continue
            out.append((top_ids[i, :n].tolist(), top_vals[i, :n].tolist(),
                        float(chosen[i]), int(ranks[i])))
        return out


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(len(token_lists), vocab, device=device)
    for i, tokens in enumerate(token_lists):
        if tokens:
            ids = torch.tensor(tokens, device=device)
            counts[i].index_add_(0, ids, torch.ones(len(tokens), device=device))
    return counts


def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """A token per row of non-negative (not necessarily normalized) probabilities: where the
    row's cumulative sum first passes a uniform draw from the row's generator times its total.
    One draw a row (an Exp(1) draw per token, the Gumbel trick's, took 136 ms for 64 rows of
    a 128k vocabulary here, against ~10 ms for this); sums in float64, so no token's share is
    lost to rounding. A row with nothing to draw from (a zero or NaN total) takes its argmax."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    total = cdf[:, -1]
    u = torch.stack([torch.rand((), generator=g, device=probs.device, dtype=torch.float64)
                     for g in generators])
    # Below the total, so the search lands on a token of positive probability.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    tokens = tokens.clamp(max=probs.shape[1] - 1)
    usable = total > 0  # (False for NaN)
    return tokens if bool(usable.all()) else torch.where(usable, tokens, probs.argmax(dim=-1))


# Candidates a top-p row's nucleus is looked for among first; a row whose nucleus is wider is
# sorted whole. topk of 1,024 of a 64 x 128k batch took ~21 ms here, its full sort ~265 ms.
_NUCLEUS_CANDIDATES = 1024


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus (top_k 0 = off), found
    among each row's best tokens (`_NUCLEUS_CANDIDATES`, or the largest top_k asked)."""
    vocab = logits.shape[1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    open_nucleus = (k == vocab) & (top_p < 1)  # a nucleus with no top-k to bound it
    bounded = k[k < vocab]
    width = min(vocab, max(int(bounded.max()) if bounded.numel() else 1,
                           _NUCLEUS_CANDIDATES if bool(open_nucleus.any()) else 1))
    values, order = logits.topk(width, dim=-1)
    # Rows without a top-k (k beyond the candidates) keep every token before top-p: their
    # candidates' probabilities are over the whole row (softmax's: a 64 x 128k batch's
    # logsumexp took ~30 ms here, its softmax ~5).
    whole = k > width
    row_probs = (torch.softmax(logits, dim=-1).gather(1, order) if bool(whole.any())
                 else None)
    kept = _nucleus(values, k, top_p, whole, row_probs)
    out = torch.full_like(logits, float("-inf")).scatter_(1, order, kept)
    unfiltered = (k == vocab) & (top_p >= 1)
    if bool(unfiltered.any()):
        out[unfiltered] = logits[unfiltered]
    wider = open_nucleus & whole & (kept[:, -1] > float("-inf"))  # its last candidate kept
    if bool(wider.any()):
        rows = logits[wider]
        ordered, row_order = rows.sort(dim=-1, descending=True)
        out[wider] = torch.full_like(rows, float("-inf")).scatter_(
            1, row_order, _nucleus(ordered, k[wider], top_p[wider], None, None))
    return out


def _nucleus(values: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
             whole: torch.Tensor | None, row_probs: torch.Tensor | None) -> torch.Tensor:
    """Sorted logits (best first) with those outside top-k and the top-p nucleus at -inf.
    Probabilities are over the kept top-k: the values' softmax, or for the rows marked
    `whole` the given `row_probs` (the values' probabilities over their whole row)."""
    rank = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
    values = values.masked_fill(rank >= k.unsqueeze(1), float("-inf"))
    probs = torch.softmax(values, dim=-1)
    if row_probs is not None and whole is not None:
        probs = torch.where(whole.unsqueeze(1), row_probs, probs)
    # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it does.
    mass_before = probs.cumsum(dim=-1) - probs
    return values.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
