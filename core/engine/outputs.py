"""What the engine returns: RequestOutput with one CompletionOutput per sample (vLLM's shape),
PoolingRequestOutput, and EngineStats (a live snapshot of the engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pkv.core.sched.kv_offload import OffloadStats


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token, its rank in the distribution, and its text."""

    logprob: float
    rank: int
    decoded_token: str


# One dict per generated token: token id -> Logprob (the chosen token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. `text` and `token_ids` are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    logprobs: SampleLogprobs | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the chosen tokens' logprobs (vLLM's); None unless logprobs were asked
        for."""
        if self.logprobs is None:
            return None
        return sum(step[token].logprob for step, token in zip(self.logprobs, self.token_ids))


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # set (with finished) when this request alone failed
    # asked by SamplingParams.prompt_logprobs: per prompt token, None for the first
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(slots=True)
class PoolingOutput:
    """What a pooling model made of one prompt: an embedding, or a classifier's scores."""

    data: torch.Tensor  # float32, 1-D

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def probs(self) -> list[float]:
        """A classifier's scores per label (after its activation)."""
        return self.data.tolist()

    @property
    def score(self) -> float:
        """A one-label cross-encoder's score (or a cosine similarity, from `LLM.score`)."""
        if self.data.numel() != 1:
            raise ValueError(f"this output holds {self.data.numel()} values, not one score")
        return float(self.data.item())


@dataclass(slots=True)
class PoolingRequestOutput:
    """The result of one embedding / scoring request (finished when returned)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class EngineStats:
    """A live snapshot of the engine, for logs, metrics and tests."""

    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_free: int
    num_cached_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_cache_usage: float
    num_prompt_tokens: int
    num_generation_tokens: int
    kv_resident_bytes: int  # KV pool memory in RAM (the pages its blocks touched so far)
    kv_offload: OffloadStats | None = None  # the disk tier's counters, when it is on
