"""Request: one sequence's tokens, progress and KV-cache bookkeeping inside the engine."""

from __future__ import annotations

import enum
import hashlib
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from pkv.core.pooling.params import PoolingParams
from pkv.core.sample.sampling_params import SamplingParams
from pkv.core.sched.thinking_budget import ThinkingBudget


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


def record_failure(failures: dict[str, Exception] | None, request_id: str,
                   exc: Exception) -> None:
    """Keep what failed for one request alone, for the engine to end that request only; with
    nobody collecting (`failures` is None), raise it."""
    if failures is None:
        raise exc
    failures[request_id] = exc


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """SHA-256 of a full block, chained from its parent so equal hashes mean equal prefixes."""
    h = hashlib.sha256(parent or b"\0")
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


@dataclass(eq=False)
class Request:
    """A single sequence. `n > 1` requests are fanned out into one Request per sample."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_size: int
    cache_salt: bytes = b""
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_draft_computed_tokens: int = 0  # tokens whose K/V a draft model holds (speculation)
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | str | None = None
    guided: Any = None  # the grammar state of a structured-output request
    lora: Any = None  # the LoRAAdapter it runs with (None: the base model)
    lora_slot: int = -1  # the adapter's slot while running
    # A pooling request (an embedding or a score): its prompt runs whole in one step, from
    # its first token (the pooler reads its rows), unless `pool_in_chunks` (a decoder pooling
    # its last token: a prefix-cache hit and chunks as any prompt, pooled at the last chunk);
    # it finishes with its pooled vector instead of sampling.
    pooling: PoolingParams | None = None
    pool_in_chunks: bool = False
    token_type_ids: list[int] | None = None  # a cross-encoder pair's segments
    thinking: ThinkingBudget | None = field(default=None, init=False)  # its thinking cap

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self._update_block_hashes()
        p = self.sampling_params
        if p.thinking_token_budget is not None:
            self.thinking = ThinkingBudget(p.thinking_token_budget,
                                           list(p.think_start_token_ids or []),
                                           list(p.think_end_token_ids or []))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        if self.guided is not None:
            self.guided.advance(token_id)
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def resalt(self, extra: bytes) -> None:
        """Add `extra` to the cache salt and rehash every block: the KV of these tokens is
        computed differently from now on (LongRoPE's long table), so blocks of the old kind
        must never be taken as this request's prefix."""
        self.cache_salt += extra
        self.block_hashes = []
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self.all_token_ids):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            tokens = self.all_token_ids[i * bs:(i + 1) * bs]
            self.block_hashes.append(hash_block(parent, tokens, self.cache_salt))

    def block_key(self, i: int) -> tuple[bytes | None, tuple[int, ...], bytes]:
        """What block i's hash stands for: parent hash, its token ids, the salt."""
        bs = self.block_size
        parent = self.block_hashes[i - 1] if i else None
        return parent, tuple(self.all_token_ids[i * bs:(i + 1) * bs]), self.cache_salt

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
