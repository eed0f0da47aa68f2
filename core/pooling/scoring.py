"""Scoring pairs of texts (vLLM's /score and LLM.score, Jina/Cohere's rerank): which pairs
a request means, and an embedding model's score of a pair (the cosine of its vectors)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]
                ) -> list[tuple[str, str]]:
    """1 x 1, 1 x N (one query against every document) or N x N (pair by pair)."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("text_1 and text_2 must not be empty")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one "
                         "text_1, or as many as text_2")
    if not all(isinstance(t, str) for t in (*first, *second)):
        raise ValueError("text_1 and text_2 must be strings or lists of strings")
    return list(zip(first, second))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """An embedding model's score of a pair."""
    return float(F.cosine_similarity(a.float(), b.float(), dim=0))
