"""InputProcessor: a prompt and its parameters in, validated Requests out.

    prompt (text, token ids, or a cross-encoder's pair of texts) + SamplingParams / PoolingParams
        -> tokenize -> check against max_model_len and the vocabulary -> adapter, grammar,
           seeded generator, prefix-cache salt -> PreparedRequest (one Request per sample)

It reads no engine state that steps change, so the server runs it off the engine's thread.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

import torch

from pkv.core.lora.adapter import LoRAAdapter, LoRARequest
from pkv.core.lora.manager import LoRAManager
from pkv.core.pooling.params import PoolingParams
from pkv.core.pooling.pooler import Pooler
from pkv.core.sample.sampling_params import SamplingParams
from pkv.core.sched.request import Request
from pkv.core.structured_output.params import DelayedGuidedState


class ContextLengthError(ValueError):
    """The prompt (plus max_tokens) does not fit in max_model_len."""


def check_context_length(prompt_len: int, max_tokens: int | None, limit: int) -> None:
    """A ContextLengthError unless the prompt leaves room for a token and for max_tokens."""
    if prompt_len >= limit:
        raise ContextLengthError(
            f"prompt has {prompt_len} tokens; max_model_len is {limit}, which must leave room "
            "for at least one generated token")
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise ContextLengthError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) "
                                 f"exceeds max_model_len ({limit})")


@dataclass(slots=True)
class PreparedRequest:
    """A validated, tokenized request, ready to be queued."""

    request_id: str
    prompt: str | None
    children: list[Request]


@dataclass(slots=True)
class InputLimits:
    """What a request is checked against."""

    vocab_size: int
    max_model_len: int
    max_num_batched_tokens: int  # a pooling request runs whole, in one step (but see below)
    block_size: int
    pool_in_chunks: bool = False  # a decoder pooling its last token: chunked as a prefill


class InputProcessor:
    """Turns prompts into Requests for one engine: its tokenizer, limits, grammar backend,
    adapters and, for a pooling model, its pooler."""

    def __init__(self, tokenizer: Any, limits: InputLimits, task: str, pooler: Pooler | None,
                 guided: Any, lora: LoRAManager | None, device: torch.device) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.task = task
        self.pooler = pooler
        self.guided = guided
        self.lora = lora
        self.device = device
        self._ids = itertools.count()
        # LoRA salts name adapters by a per-process load number: this makes their blocks'
        # keys (and so their files in the disk tier) this process's own.
        self._lora_salt_nonce = os.urandom(8).hex().encode()

    def prepare(self, request_id: str | None, prompt: str | list[int] | tuple[str, str],
                params: SamplingParams | PoolingParams | None = None,
                cache_salt: str | None = None,
                lora_request: LoRARequest | None = None, *,
                cap_max_tokens: bool = False) -> PreparedRequest:
        """Tokenize and validate (ValueError on bad input). PoolingParams make an embedding /
        scoring request (a pair of texts: a cross-encoder's query and document).
        `cap_max_tokens`: a max_tokens past max_model_len stops the output there (vLLM's
        offline rule) instead of refusing the request (OpenAI's)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if isinstance(params, PoolingParams):
            adapter = self._adapter(lora_request)
            return self._prepare_pooling(request_id, prompt, params, adapter,
                                         self._salt(cache_salt, adapter))
        if self.pooler is not None:
            raise ValueError(f"this model serves task={self.task} (embeddings or scores), "
                             "not text generation")
        if isinstance(prompt, tuple):
            raise ValueError("a pair of texts is a cross-encoder's input, not a prompt")
        params = params or SamplingParams()
        # -1 keeps as many as leave max_tokens (at least one) of room
        room = self.limits.max_model_len - (params.max_tokens or 1)
        prompt_text, prompt_ids = self._tokenize(prompt, params.truncate_prompt_tokens,
                                                 max(1, room))
        self._validate(prompt_ids, params, cap_max_tokens)
        adapter = self._adapter(lora_request)
        grammar = (self.guided.compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        eos = frozenset(self.tokenizer.eos_token_ids)
        salt = self._salt(cache_salt, adapter)
        children = [
            Request(request_id if params.n == 1 else f"{request_id}#{i}", prompt_ids, params,
                    eos, self.limits.block_size, salt, self._generator(params.seed, i),
                    guided=self._guided_state(grammar, params), lora=adapter)
            for i in range(params.n)
        ]
        return PreparedRequest(request_id, prompt_text, children)

    def _salt(self, cache_salt: str | None, adapter: LoRAAdapter | None) -> bytes:
        """What sets a request's prefix-cache blocks apart: its salt (the tenant's), and the
        adapter they are computed under."""
        # The client's part is length-prefixed: no salt can spell the engine's own parts
        # (an adapter's, LongRoPE's "\0longrope") and take their blocks.
        data = cache_salt.encode() if cache_salt else b""
        salt = len(data).to_bytes(4, "little") + data if data else b""
        if adapter is not None:  # blocks computed under an adapter are its own
            salt += b"\0lora:" + str(adapter.uid).encode() + b"@" + self._lora_salt_nonce
        return salt

    def _prepare_pooling(self, request_id: str, prompt: str | list[int] | tuple[str, str],
                         params: PoolingParams, adapter: LoRAAdapter | None = None,
                         salt: bytes = b"") -> PreparedRequest:
        pooler = self.pooler
        if pooler is None:
            raise ValueError("this model generates text; embeddings and scores need a pooling "
                             "model (pkv serve MODEL --task embed)")
        pooler.check(params)
        types = None
        chunks = self.limits.pool_in_chunks
        limit = (self.limits.max_model_len if chunks
                 else min(self.limits.max_model_len, self.limits.max_num_batched_tokens))
        if isinstance(prompt, tuple):
            if params.truncate_prompt_tokens is not None:
                raise ValueError("truncate_prompt_tokens applies to one text, not to a "
                                 "cross-encoder's pair")
            if not pooler.classifies:
                raise ValueError("a pair of texts is a cross-encoder's input; this model "
                                 "embeds one text at a time")
            if not all(isinstance(t, str) and t for t in prompt) or len(prompt) != 2:
                raise ValueError("a pair must be two non-empty texts")
            text: str | None = None
            ids, types = self.tokenizer.encode_pair(*prompt)
        else:
            text, ids = self._tokenize(prompt, params.truncate_prompt_tokens, limit)
        if len(ids) > limit:
            raise ContextLengthError(f"input has {len(ids)} tokens; this model takes at most "
                                     f"{limit}")
        request = Request(request_id, ids, SamplingParams(max_tokens=None), frozenset(),
                          self.limits.block_size, salt, pooling=params, token_type_ids=types,
                          lora=adapter, pool_in_chunks=chunks)
        return PreparedRequest(request_id, text, [request])

    def _adapter(self, lora_request: LoRARequest | None) -> LoRAAdapter | None:
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request takes a LoRARequest(lora_name, lora_int_id, "
                            f"lora_path), not a {type(lora_request).__name__}")
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters: start it with "
                             "enable_lora=True (pkv serve --enable-lora)")
        return self.lora.resolve(lora_request)

    def _guided_state(self, grammar: Any, params: SamplingParams) -> Any:
        if grammar is None:
            return None
        after = params.structured_outputs.starts_after  # type: ignore[union-attr]
        if after is None:
            return grammar.new_state()
        marker = self.tokenizer.encode(after, add_special_tokens=False)
        return DelayedGuidedState(grammar.new_state(), marker)

    def _tokenize(self, prompt: str | list[int], truncate: int | None = None,
                  limit: int = 0) -> tuple[str | None, list[int]]:
        """The prompt's text (None for ids) and ids; with `truncate` (-1: `limit`) only the
        last that many tokens, a text's special tokens kept around them."""
        keep = limit if truncate == -1 else truncate
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            # No token covers more characters than the longest token's text: a text longer
            # than the model could take is refused without the seconds tokenizing it costs
            # (a few 4 MiB bodies starved every running stream of CPU).
            most = self.limits.max_model_len * self.tokenizer.max_token_chars
            if keep is None and len(prompt) > most:
                raise ContextLengthError(f"prompt has {len(prompt)} characters, more than "
                                         f"max_model_len ({self.limits.max_model_len}) tokens "
                                         "of this model can hold")
            ids = self.tokenizer.encode(prompt)
            if keep is not None and len(ids) > keep:
                ids = self._last(prompt, ids, keep)
            return prompt, ids
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.limits.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                   for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return None, ids if keep is None else ids[-keep:]

    def _last(self, text: str, ids: list[int], keep: int) -> list[int]:
        """A text's ids cut to `keep`, as a tokenizer truncating on the left cuts them: the
        special tokens it adds around the text (BOS; BERT's [CLS] and [SEP]) stay."""
        body = self.tokenizer.encode(text, add_special_tokens=False)
        lead = next((i for i in range(min(4, len(ids) - len(body)) + 1)
                     if ids[i:i + len(body)] == body), None)
        if lead is None:  # the specials are not simply around the text: cut the ids
            return ids[-keep:]
        tail = ids[lead + len(body):]
        room = keep - lead - len(tail)
        if room < 1:
            raise ValueError(f"truncate_prompt_tokens={keep} leaves no room beside the "
                             f"{lead + len(tail)} special tokens the tokenizer adds")
        return ids[:lead] + body[-room:] + tail

    def _validate(self, prompt_ids: list[int], params: SamplingParams,
                  cap_max_tokens: bool) -> None:
        check_context_length(len(prompt_ids), None if cap_max_tokens else params.max_tokens,
                             self.limits.max_model_len)
        vocab = self.limits.vocab_size
        for name in ("stop_token_ids", "think_start_token_ids", "think_end_token_ids",
                     "allowed_token_ids"):
            if any(not 0 <= t < vocab for t in getattr(params, name) or []):
                raise ValueError(f"{name} must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.logit_bias or {}):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words(params.bad_words)
        if params.allowed_token_ids is not None:
            self._check_something_allowed(params)

    def _check_something_allowed(self, params: SamplingParams) -> None:
        """ValueError where the bans leave none of allowed_token_ids (every logit would be
        -inf, and the sampler's argmax token 0, allowed or not)."""
        banned = {word[0] for word in params.bad_words_token_ids if len(word) == 1}
        if params.min_tokens:  # until then no stop token or end of sequence
            banned |= set(params.stop_token_ids) | set(self.tokenizer.eos_token_ids)
        if set(params.allowed_token_ids or []) <= banned:
            raise ValueError("allowed_token_ids: every allowed token is banned (by bad_words, "
                             "or as a stop token or the end of sequence before min_tokens)")

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens as it starts the text and, where the tokenizer gives a
        word after a space other tokens of the same count, as it follows one (vLLM's rule:
        a word is banned wherever it would begin)."""
        out = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not bare:
                raise ValueError(f"bad_words: {word!r} has no tokens")
            out.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        return out

    def _generator(self, seed: int | None, index: int) -> torch.Generator | None:
        if seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed((seed * 1_000_003 + index) % (2**63))
        return generator
