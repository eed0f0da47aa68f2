"""Per-request sampling parameters, validated at construction (vLLM's names and meanings)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from pkv.core.structured_output.params import StructuredOutputsParams


_INTEGERS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
             "thinking_token_budget", "truncate_prompt_tokens")
_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty")
_TOKEN_LISTS = ("stop_token_ids", "think_start_token_ids", "think_end_token_ids",
                "allowed_token_ids")
_FLAGS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
# Below this a temperature samples greedily (vLLM's bound): logits / 1e-40 overflow float32.
GREEDY_TEMPERATURE = 1e-5


def check_truncate_prompt_tokens(value: int | None) -> None:
    """ValueError unless `value` is None, -1 or a positive integer."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or (value < 1 and value != -1)):
        raise ValueError("truncate_prompt_tokens must be -1 (as many as fit) or a positive "
                         f"integer, got {value!r}")


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    A temperature below 1e-5 (or 0) is greedy. A `stop` string, or the stop token
    (`stop_token_ids`, the end of sequence) that ended the text, is left out of it unless
    `include_stop_str_in_output`; none ends the text before it has `min_tokens` tokens.
    Penalties follow OpenAI (presence/frequency over generated tokens) and vLLM/HF
    (repetition over prompt and generated tokens). `allowed_token_ids` and `bad_words` (words
    never generated, at the start of the text or inside it) are vLLM's."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None  # added to the logits before sampling
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob and top-N (vLLM's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # A cap on the thinking block (core/sched/thinking_budget.py): its tokens by id, set by
    # whoever knows the model (the server, from its reasoning parser and tokenizer).
    thinking_token_budget: int | None = None
    think_start_token_ids: list[int] | None = None  # empty or None: opened by the prompt
    think_end_token_ids: list[int] | None = None
    # Keep only the prompt's last N tokens (vLLM's; the tokenizer's special tokens around a
    # text stay); -1: as many as leave max_tokens (at least one) within max_model_len.
    truncate_prompt_tokens: int | None = None
    _stop: list[str] = field(default_factory=list, init=False, repr=False)
    # bad_words as token sequences, set by the input processor (it knows the tokenizer)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        self._check_types()
        if isinstance(self.stop, str):
            self._stop = [self.stop]
        else:
            self._stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty (None: every token)")
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0  # vLLM uses -1 for "off"; both mean off here.
        self._validate()

    def _check_types(self) -> None:
        """ValueError naming the first field of the wrong type: each is checked here, once,
        not deep in a step (where a float `logprobs` would fail in the sampler's topk)."""
        for name in _INTEGERS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in _NUMBERS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}")
        for name in _TOKEN_LISTS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):
                raise ValueError(f"{name} must be a list of token ids, got {value!r}")
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.bad_words is not None and not (isinstance(self.bad_words, (list, tuple)) and all(
                isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-empty strings, got "
                             f"{self.bad_words!r}")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must map token ids to numbers in [-100, 100]")

    def _validate(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        check(0 <= self.temperature < math.inf,
              f"temperature must be finite and >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(isinstance(self.top_k, int) and self.top_k >= 0,
              f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}")
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.seed is None or -2**63 <= self.seed < 2**64,
              f"seed must be a 64-bit integer, got {self.seed}")
        check(
            self.max_tokens is None or self.max_tokens >= 1,
            f"max_tokens must be >= 1, got {self.max_tokens}",
        )
        check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        check(-2 <= self.presence_penalty <= 2,
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2 <= self.frequency_penalty <= 2,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(0 < self.repetition_penalty < math.inf,
              f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")
        check(self.logprobs is None or 0 <= self.logprobs <= 20,
              f"logprobs must be in [0, 20], got {self.logprobs}")
        check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
              f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        check(all(isinstance(t, int) and not isinstance(t, bool) and isinstance(b, (int, float))
                  and -100 <= b <= 100 for t, b in (self.logit_bias or {}).items()),
              "logit_bias must map token ids to numbers in [-100, 100]")
        check(all(isinstance(s, str) and s for s in self._stop),
              "stop must be a non-empty string or a list of non-empty strings")
        check(self.thinking_token_budget is None or self.thinking_token_budget >= 0,
              f"thinking_token_budget must be >= 0, got {self.thinking_token_budget}")
        check(self.thinking_token_budget is None or bool(self.think_end_token_ids),
              "thinking_token_budget needs think_end_token_ids (the end-of-thinking tokens)")
        # (the tokens the budget writes would land inside the constrained output)
        check(self.thinking_token_budget is None or self.structured_outputs is None
              or self.structured_outputs.starts_after is not None,
              "thinking_token_budget with structured_outputs needs structured_outputs."
              "starts_after (the end of thinking): a constraint from the first token leaves "
              "no thinking block to cap")

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    def bad_word_bans(self, output_token_ids: list[int]) -> list[int]:
        """The tokens that would complete a bad word now: each word's last token where the
        output ends with the rest of the word (vLLM's rule)."""
        bans = []
        for word in self.bad_words_token_ids:
            *prefix, last = word
            if not prefix or output_token_ids[-len(prefix):] == prefix:
                bans.append(last)
        return bans

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's), to change one request's parameters and not another's."""
        return copy.deepcopy(self)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def _structured_outputs(value: Any) -> StructuredOutputsParams | None:
    """`structured_outputs` as given, or a dict of its fields (the server's JSON shape) made
    into one; ValueError for anything else."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        try:
            return StructuredOutputsParams(**value)
        except TypeError:
            raise ValueError(f"structured_outputs takes json, regex, choice, json_object and "
                             f"starts_after, got {sorted(value)}") from None
    raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict of its "
                     f"fields, got {value!r}")
