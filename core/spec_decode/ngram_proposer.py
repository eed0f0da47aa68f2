"""NgramProposer: prompt lookup. Guess the next tokens by finding the sequence's last few
tokens earlier in its own prompt or output and proposing what followed them there.

    ... the quick brown fox jumps over ... the quick brown | fox jumps over
                     ^ earlier match of the suffix           ^ proposed

The longest suffix (prompt_lookup_max tokens down to prompt_lookup_min) that occurred
before wins; among its matches the most recent one.
"""

from __future__ import annotations

import numpy as np

from pkv.core.config.speculative import SpeculativeConfig
from pkv.core.sched.request import Request


class NgramProposer:
    """Proposes up to k tokens per sequence from the sequence itself; no model runs."""

    kv_bytes_per_block = 0  # holds no KV

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def allocate_kv(self, num_blocks: int) -> None:
        """Nothing to allocate."""

    def propose(self, requests: list[Request], lookahead: dict[str, int],
                tables: dict[str, list[list[int]]], high_watermark: int,
                held_from: dict[str, int] | None = None) -> dict[str, list[int]]:
        """Up to lookahead[id] drafts per request (none where nothing matches)."""
        return {r.request_id: self.lookup(r.all_token_ids, lookahead[r.request_id])
                for r in requests}

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest, longest earlier match of the suffix."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        last = len(tokens) - 1
        if last < 1 or k < 1:
            return []
        # Candidate match ends (before the suffix's own last token), narrowed one token back
        # at a time while they keep matching the suffix.
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        best = ends if self.min_n <= 1 else ends[:0]
        for j in range(1, min(self.max_n, last + 1)):
            ends = ends[ends >= j]
            ends = ends[tokens[ends - j] == tokens[last - j]]
            if ends.size == 0:
                break
            if j + 1 >= self.min_n:
                best = ends
        if best.size == 0:
            return []
        start = int(best[-1]) + 1
        return tokens[start:start + k].tolist()
