"""The tokenizer a GGUF file describes (`tokenizer.ggml.*`), built with the `tokenizers`
library so that it tokenizes as llama.cpp does with the same file.

- `gpt2`: byte-level BPE; the file lists the merges.
- `llama`: SentencePiece BPE (Llama 2, Mistral, Mixtral, Phi-3, Gemma 2/3). Pieces spell a
  space as U+2581 (▁); a character no piece holds becomes byte pieces `<0xNN>` (byte
  fallback). llama.cpp merges the adjacent pair whose concatenation has the highest score; a
  `tokenizers` BPE does the same with one merge per split of every piece, ranked by the
  piece's score (the Hugging Face converter's rule and tie order, so a Hub tokenizer.json of
  the same model agrees). Merges the file lists rank as listed (older converters write them,
  and converters working from a tokenizer.json, whose scores are then all -1000).

      text --split out control / unknown / user-defined tokens (raw text)--> fragments
           --add_space_prefix: "▁" before each fragment; " " -> "▁"--> BPE, byte fallback

  Decoding undoes it: "▁" -> " ", byte pieces -> bytes, and with add_space_prefix the one
  leading space the prefix added comes off again.

Token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte. Unknown and
control tokens are special (matched in text, dropped by skip_special_tokens); user-defined ones
are matched whole in the raw text, as llama.cpp does (its converter stores their ▁ as a space).

Not built: Unigram SentencePiece (`t5`), WordPiece (`bert`), RWKV and others are refused in
one line; `tokenizer.ggml.add_eos_token` is not honoured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from pkv.core.tokenizer.tokenizer import Tokenizer

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_SPACE = "\u2581"

# GGUFFile.field: (key, default) -> the metadata value, or default when the key is absent
Field = Callable[..., Any]


def gguf_tokenizer(field: Field) -> Tokenizer:
    """The Tokenizer of a GGUF file, from its `tokenizer.*` metadata."""
    kind = field("tokenizer.ggml.model")
    if kind not in _BUILDERS:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (pkv builds 'gpt2' "
                         "byte-level BPE and 'llama' SentencePiece BPE)")
    tokens: list[str] = field("tokenizer.ggml.tokens")
    types: list[int] = field("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"GGUF tokenizer: {len(tokens)} tokens but {len(types)} token types")
    backend = _BUILDERS[kind](field, tokens, types)
    # llama.cpp ends generation on EOS, end-of-turn and end-of-message tokens.
    eos = {field(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")} - {None}
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
    add_bos = field("tokenizer.ggml.add_bos_token", kind == "llama")
    return Tokenizer(backend, bos_token_id=field("tokenizer.ggml.bos_token_id"),
                     eos_token_ids=eos, add_bos_token=bool(add_bos),
                     chat_template=field("tokenizer.chat_template"))


def _byte_level_bpe(field: Field, tokens: list[str], types: list[int]) -> HFTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
    backend = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                     fuse_unk=False, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if field("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "codeshell"):
        # These vocabularies split every digit on its own before the GPT-2 regex.
        byte_level = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([t for t, k in zip(tokens, types) if k == _CONTROL])
    backend.add_tokens([t for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return backend


def _sentencepiece_bpe(field: Field, tokens: list[str], types: list[int]) -> HFTokenizer:
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)  # a spelling listed twice keeps its first id
    listed = field("tokenizer.ggml.merges")
    if listed is not None:
        pairs = (m.split(" ", 1) for m in listed)
        merges = [(a, b) for a, b in pairs if a in vocab and b in vocab and a + b in vocab]
    else:
        scores = field("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ValueError("GGUF SentencePiece tokenizer without merges needs one "
                             "tokenizer.ggml.scores entry per token")
        merges = merges_from_scores(tokens, scores, vocab)
    unk_id = field("tokenizer.ggml.unknown_token_id")
    if unk_id is None:
        unk_id = next((i for i, k in enumerate(types) if k == _UNKNOWN), None)
    backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True,
                                     unk_token=None if unk_id is None else tokens[unk_id]))
    prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(_SPACE)] if prefix else []) + [normalizers.Replace(" ", _SPACE)])
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(
        steps + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k in (_UNKNOWN, _CONTROL) and t])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED and t])
    return backend


def merges_from_scores(tokens: list[str], scores: list[float],
                       vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split (left, right) of a piece into two pieces, best piece score first.

    Ties rank as Hugging Face's converter ranks them (longer left part, then longer right
    part, then piece id, then the parts' ids), so the result is its merge list."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece_id, piece in enumerate(tokens):
        if vocab[piece] != piece_id:
            continue  # a second spelling of an earlier piece
        splits = sorted((vocab[piece[:k]], vocab[piece[k:]], piece[:k], piece[k:])
                        for k in range(1, len(piece))
                        if piece[:k] in vocab and piece[k:] in vocab)
        score = float(scores[piece_id])
        ranked += [(-score, -len(left), -len(right), left, right)
                   for _, _, left, right in splits]
    ranked.sort(key=lambda r: r[:3])  # stable: piece id, then the parts' ids, break ties
    return [(left, right) for *_, left, right in ranked]


_BUILDERS: dict[str, Callable[[Field, list[str], list[int]], HFTokenizer]] = {
    "gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
