"""`outlines` guided decoding: constraints compiled by outlines-core into an index over the
model's vocabulary; each step a constrained row's logits are masked to the allowed tokens.

The vocabulary is built from the local tokenizer (never from a hub): byte-level BPE tokens
are mapped back to the bytes they stand for. EOS is allowed only in accepting states.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import OrderedDict
from typing import Any

import torch

from pkv.core.structured_output.params import StructuredOutputsParams
from pkv.plugins.guided.compiling import CompilingBackend
from pkv.plugins.guided.schema_rewrite import SchemaRewriter

_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes_map(tokenizer: Any) -> dict[bytes, list[int]]:
    """Every ordinary token's bytes -> its ids (special and EOS tokens left out)."""
    from tokenizers import decoders

    skip = set(tokenizer.special_token_ids) | set(tokenizer.eos_token_ids)
    vocab = tokenizer.backend.get_vocab(with_added_tokens=False)
    byte_level = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
    decode = _byte_decoder()
    out: dict[bytes, list[int]] = {}
    for token, tid in vocab.items():
        if tid in skip:
            continue
        if byte_level:
            data = bytes(decode[c] for c in token)
        elif token.startswith("<0x") and token.endswith(">") and len(token) == 6:
            data = bytes([int(token[3:5], 16)])  # SentencePiece byte fallback
        else:
            data = token.replace("\u2581", " ").encode()
        out.setdefault(data, []).append(tid)
    return out


def choice_regex(choices: tuple[str, ...] | list[str]) -> str:
    """Exactly one of the strings."""
    escape = lambda s: "".join("\\" + c if c in _REGEX_META else c for c in s)
    return "(" + "|".join(escape(c) for c in choices) + ")"


def to_regex(params: StructuredOutputsParams) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    if params.kind == "regex":
        return params.regex or ""
    if params.kind == "choice":
        return choice_regex(params.choice or ())
    rewriter = SchemaRewriter(params.json if params.kind == "json" else {"type": "object"})
    regex = build_regex_from_schema(json.dumps(rewriter.schema))
    for key, number in rewriter.numbers.items():
        regex = regex.replace(f'"{key}"', f"(?:{number})")
    return regex


# Token masks of every grammar share one LRU budget: a mask is one byte per vocabulary entry
# (48 KiB for SmolLM2), so a per-grammar count bound alone would let 64 grammars x 1024
# states hold 3 GiB.
DEFAULT_MASK_CACHE_BYTES = 64 * 2**20


class MaskCache:
    """Allowed-token masks by (grammar, state), least recently used evicted past `max_bytes`."""

    def __init__(self, max_bytes: int = DEFAULT_MASK_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._masks: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self._uids = itertools.count()

    def new_uid(self) -> int:
        return next(self._uids)

    def get(self, key: tuple[int, int]) -> torch.Tensor | None:
        with self._lock:
            mask = self._masks.get(key)
            if mask is not None:
                self._masks.move_to_end(key)
            return mask

    def put(self, key: tuple[int, int], mask: torch.Tensor) -> None:
        with self._lock:
            if key in self._masks:
                return
            self._masks[key] = mask
            self.nbytes += mask.nbytes
            while self.nbytes > self.max_bytes and self._masks:
                _, old = self._masks.popitem(last=False)
                self.nbytes -= old.nbytes

    def __len__(self) -> int:
        return len(self._masks)


class CompiledGrammar:
    """An outlines-core Index; its token masks live in the backend's shared MaskCache."""

    def __init__(self, index: Any, vocab_size: int, masks: MaskCache) -> None:
        self.index = index
        self.vocab_size = vocab_size
        self.masks = masks
        self.uid = masks.new_uid()  # never reused, unlike id() of a collected grammar

    def mask(self, state: int) -> torch.Tensor:
        """Boolean [vocab] of the tokens allowed in `state`."""
        key = (self.uid, state)
        cached = self.masks.get(key)
        if cached is not None:
            return cached
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[torch.tensor(self.index.get_allowed_tokens(state), dtype=torch.long)] = True
        self.masks.put(key, mask)
        return mask

    def new_state(self) -> GuidedState:
        return GuidedState(self, self.index.get_initial_state())


class GuidedState:
    """One sequence's position in its grammar."""

    def __init__(self, grammar: CompiledGrammar, state: int) -> None:
        self.grammar = grammar
        self.state = state

    def allowed_mask(self) -> torch.Tensor:
        return self.grammar.mask(self.state)

    def advance(self, token_id: int) -> None:
        nxt = self.grammar.index.get_next_state(self.state, token_id)
        if nxt is not None:  # EOS in a final state has no next state: stay there
            self.state = nxt


# A regular expression this long takes outlines-core ~4 s to index over a 49k vocabulary;
# a schema of 2000 optional properties would make one of 92 MB.
MAX_REGEX_CHARS = 512 * 1024


class OutlinesBackend(CompilingBackend):
    """Constraints compiled by outlines-core into an Index; masks cached by (grammar, state)."""

    name = "outlines"

    def __init__(self, tokenizer: Any, vocab_size: int, timeout_s: float = 30.0,
                 cache_size: int = 64, mask_cache_bytes: int = DEFAULT_MASK_CACHE_BYTES) -> None:
        super().__init__(timeout_s, cache_size)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.masks = MaskCache(mask_cache_bytes)
        self._vocabulary: Any = None

    def cache_sizes(self) -> dict[str, tuple[float, float | None, str]]:
        return {**super().cache_sizes(),
                "outlines token masks": (self.masks.nbytes, self.masks.max_bytes, "bytes")}

    def _build(self, params: StructuredOutputsParams) -> CompiledGrammar:
        from outlines_core import Index, Vocabulary

        if self._vocabulary is None:
            eos = self.tokenizer.eos_token_id
            self._vocabulary = Vocabulary(eos, token_bytes_map(self.tokenizer))
        regex = to_regex(params)
        if len(regex) > MAX_REGEX_CHARS:
            raise ValueError(f"too large to compile: its regular expression has "
                             f"{len(regex)} characters, over {MAX_REGEX_CHARS} (optional "
                             "properties multiply it: make more of them required, or "
                             "split the schema)")
        return CompiledGrammar(Index(regex, self._vocabulary), self.vocab_size, self.masks)
