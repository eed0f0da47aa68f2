"""SpeculativeConfig: how the engine guesses tokens ahead for the target model to verify.

vLLM's `speculative_config` dict, validated before anything loads:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 4}                       # prompt lookup over the request's own tokens
    {"model": "path/or/hub-id", "num_speculative_tokens": 4}   # a small draft model
    ... "disable_by_batch_size": 8                 # stop guessing while more than 8 requests run
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative-decoding setup."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft model (method draft_model)
    quantization: str | None = "auto"  # the draft's weight format, as EngineConfig's
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: dict[str, Any] | str) -> SpeculativeConfig:
        """From a dict or its JSON text (the CLI's `--speculative-config`); every mistake is
        a one-line ValueError."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        options = dict(value)
        if "method" not in options:
            options["method"] = "draft_model" if options.get("model") else "ngram"
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config needs num_speculative_tokens")
        return cls(**options)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError("speculative_config num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "ngram":
            self._check_lookup()
            if self.model is not None:
                raise ValueError("speculative_config: method ngram takes no model")
        elif not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config: method draft_model needs a model "
                             "(a folder, .gguf file or hub id)")
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                                  or limit < 1):
            raise ValueError("speculative_config disable_by_batch_size must be an integer "
                             f">= 1, got {limit!r}")

    def _check_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, "
                                 f"got {value!r}")
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi})")

    def speculates_with(self, num_running: int) -> bool:
        """Whether a step with `num_running` requests speculates at all."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size
