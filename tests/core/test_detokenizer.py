"""Incremental detokenization: streamed pieces add up to the full decode, never a broken
character, across multi-byte UTF-8 split over tokens and BPE merges."""

from __future__ import annotations

import pytest

from pkv.core.tokenizer.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! This is plain ASCII text.",
    "naïve café, crème brûlée — “quotes” and ellipsis…",
    "中文字符和日本語のテキスト、한국어도 있어요",
    "emoji: 🙂🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 mixed with text",
    "    indented code:\n\tif x != y:\n\t\treturn {'a': [1, 2, 3]}",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_equal_full_decode(smol_llm, text: str):
    tokenizer = smol_llm.get_tokenizer()
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add_token(t) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    if text in TEXTS[2:4]:
        assert "" in pieces  # some character really was split over several tokens


def test_special_tokens_are_skipped(smol_llm):
    tokenizer = smol_llm.get_tokenizer()
    detok = IncrementalDetokenizer(tokenizer, [1])
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [2]
    assert "".join(detok.add_token(t) for t in ids) == "Hi"
