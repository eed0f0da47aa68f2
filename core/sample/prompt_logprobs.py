"""Prompt logprobs (vLLM's `prompt_logprobs`): how likely the model found each prompt token
after the ones before it, from the logits of the prompt's own rows.

A request that asks for them computes every prompt row (no prefix-cache hit: a cached
block has no logits) and its prefill chunks hand their rows' logits here; the first prompt
token has none (nothing comes before it).
"""

from __future__ import annotations

import torch

# (top-k ids, their logprobs, the prompt token's logprob, its rank), as the sampler's entries
LogprobEntry = tuple[list[int], list[float], float, int]


def prompt_rows(start: int, num_tokens: int, prompt_len: int) -> int:
    """How many of a chunk's first rows (positions `start`..) predict a prompt token: the
    row at position p predicts token p + 1."""
    return max(0, min(num_tokens, prompt_len - 1 - start))


def entries(logits: torch.Tensor, targets: list[int], top_n: int) -> list[LogprobEntry]:
    """Each row's entry for its target token (the prompt's next one), from raw logits."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(targets, device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_vals, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (logprobs[:, :0],
                                                                    logprobs[:, :0].long())
    return [(top_ids[i].tolist(), top_vals[i].tolist(), float(chosen[i, 0]), int(ranks[i]))
            for i in range(len(targets))]
