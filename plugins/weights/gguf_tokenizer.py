"""The tokenizer a GGUF file describes (`tokenizer.ggml.*`), built with the `tokenizers`
library so that it tokenizes as llama.cpp does with the same file.

- `gpt2`: byte-level BPE; the file lists the merges. `tokenizer.ggml.pre` names the split
  that cuts text into the pieces merges run within, as llama.cpp's table has it
  (PRE_TOKENIZER_SPLITS below: Qwen2 keeps "(arr", "-th", ":\n" whole where GPT-2 cuts them,
  Llama 3 groups digits in threes, SmolLM splits every digit, ...). Each regex of a name cuts
  every fragment the ones before it left, matches and the text between them both kept (a
  `tokenizers` Split, "isolated"); bytes are then spelled in GPT-2's alphabet. A file without
  `pre` gets llama.cpp's `default` (not GPT-2's split); a name not in the table is refused
  in one line. As in llama.cpp, Llama 3 and Tekken take a fragment the vocabulary holds whole
  as one token before merging, and add BOS (so does Chameleon) when the file does not say.
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
- `bert`: WordPiece (BERT embedding models): the converter's "phantom space" vocabulary back
  in WordPiece's own form (`▁w` -> `w`, `w` -> `##w`), BERT's normalizer and split, and
  [CLS] a [SEP] around a prompt.

Token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte. Unknown and
control tokens are special (matched in text, dropped by skip_special_tokens); user-defined ones
are matched whole in the raw text, as llama.cpp does (its converter stores their ▁ as a space).

`tokenizer.ggml.add_eos_token` ends an encoded text with EOS where special tokens are added
(Qwen3-Embedding's files), as llama.cpp does.

Not built: Unigram SentencePiece (`t5`), RWKV and others are refused in one line. Pre-tokenizer
names llama.cpp knows but the table lacks are refused too: custom splitters (`kimi-k2`,
`afmoe`, `superbpe`), SentencePiece-style BPE (`gemma4`, `sarvam-moe`), encoders that add SEP
(`roberta-bpe`, `jina-v1-en`, `jina-v2-code`) and newer or rarer ones (`seed-coder`,
`bailingmoe`, `youtu`, ...). Decoding does not apply llama.cpp's `clean_spaces`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import (AddedToken, Regex, decoders, models, normalizers, pre_tokenizers,
                        processors)
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
                         "byte-level BPE, 'llama' SentencePiece BPE and 'bert' WordPiece)")
    tokens: list[str] = field("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError("GGUF tokenizer: tokenizer.ggml.tokens is missing or not a list of "
                         "strings")
    types: list[int] = field("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"GGUF tokenizer: {len(tokens)} tokens but {len(types)} token types")
    backend = _BUILDERS[kind](field, tokens, types)
    # llama.cpp ends generation on EOS, end-of-turn and end-of-message tokens.
    eos = {field(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")} - {None}
    # llama.cpp adds BOS to a SentencePiece vocabulary, and to a few byte-level ones (Llama 3,
    # Tekken), that do not say otherwise; WordPiece's [CLS] comes from its post-processor.
    add_bos = kind != "bert" and field("tokenizer.ggml.add_bos_token", kind == "llama"
                                       or field("tokenizer.ggml.pre") in _ADD_BOS)
    # EOS after the text where the file says so, as llama.cpp (Qwen3-Embedding's files: their
    # last-token pooling reads the EOS)
    appended_eos = (field("tokenizer.ggml.eos_token_id")
                    if kind != "bert" and field("tokenizer.ggml.add_eos_token", False) else None)
    return Tokenizer(backend, bos_token_id=field("tokenizer.ggml.bos_token_id"),
                     eos_token_ids=eos, add_bos_token=bool(add_bos),
                     chat_template=field("tokenizer.chat_template"),
                     appended_eos_id=appended_eos,
                     own_eos_id=field("tokenizer.ggml.eos_token_id"))


def _token_at(tokens: list[str], token_id: Any, key: str) -> str:
    """The token `tokenizer.ggml.{key}` names; a ValueError if it names none."""
    if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
        raise ValueError(f"GGUF tokenizer.ggml.{key} is {token_id!r}, not a token of the "
                         f"{len(tokens)} in the vocabulary")
    return tokens[token_id]


def _byte_level_bpe(field: Field, tokens: list[str], types: list[int]) -> HFTokenizer:
    pre = field("tokenizer.ggml.pre") or "default"  # llama.cpp's choice for a file without one
    listed = field("tokenizer.ggml.merges")
    if listed is None:  # (llama.cpp refuses such a file too: the text would split otherwise)
        raise ValueError("GGUF byte-level BPE tokenizer without tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in listed if isinstance(m, str)]
    bad = next((m for m, pair in zip(listed, merges)
                if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab), None)
    if len(merges) != len(listed) or bad is not None:
        raise ValueError(f"GGUF tokenizer.ggml.merges holds {bad!r}, not two tokens of the "
                         "vocabulary joined by a space")
    backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False,
                                     ignore_merges=pre in _IGNORE_MERGES))
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([t for t, k in zip(tokens, types) if k == _CONTROL])
    backend.add_tokens([t for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return backend


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's split for `tokenizer.ggml.pre`: each regex cuts every fragment the ones
    before it left, keeping matches and the text between them; then bytes -> GPT-2's
    alphabet."""
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not a pre-tokenizer pkv knows "
                         f"(known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))})")
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated")
              for regex in PRE_TOKENIZER_SPLITS[pre]]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


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
                                     unk_token=None if unk_id is None
                                     else _token_at(tokens, unk_id, "unknown_token_id")))
    prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(_SPACE)] if prefix else []) + [normalizers.Replace(" ", _SPACE)])
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(
        steps + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    # Phi-3's own tokenizer takes the whitespace after its chat markers (rstrip) and llama.cpp
    # does the same for its files; Phi-4 (arch phi3 too) has a byte-level vocabulary.
    rstrip = field("general.architecture") == "phi3"
    backend.add_special_tokens([
        AddedToken(t, special=True, normalized=False, rstrip=rstrip and t not in _NO_RSTRIP)
        for t, k in zip(tokens, types) if k in (_UNKNOWN, _CONTROL) and t])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED and t])
    return backend


_NO_RSTRIP = ("<unk>", "<s>", "<|endoftext|>")  # Phi-3's special tokens without it


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


def _wordpiece(field: Field, tokens: list[str], types: list[int]) -> HFTokenizer:
    """BERT's WordPiece. The converter wrote the vocabulary in "phantom space" form (a
    word-initial piece `w` as `▁w`, a continuation `##w` as `w`, control tokens as they
    are): undone here, the vocabulary is the checkpoint's again. Lowercasing and accent
    stripping come from the file where it says (newer converters); an older file, which
    says nothing, is lowercased when its vocabulary has no capital letters (an uncased
    model: what its own tokenizer did), else left as written."""
    vocab: dict[str, int] = {}
    for token_id, (token, kind) in enumerate(zip(tokens, types)):
        piece = token if kind == _CONTROL else token[1:] if token.startswith(_SPACE) \
            else "##" + token
        vocab.setdefault(piece, token_id)
    unk_id = field("tokenizer.ggml.unknown_token_id", vocab.get("[UNK]", 100))
    backend = HFTokenizer(models.WordPiece(vocab,
                                           unk_token=_token_at(tokens, unk_id,
                                                               "unknown_token_id"),
                                           max_input_chars_per_word=100))
    cased = any(c.isupper() for t, k in zip(tokens, types) if k != _CONTROL for c in t)
    lowercase = bool(field("tokenizer.ggml.normalizer.lowercase", not cased))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, lowercase=lowercase,
        strip_accents=bool(field("tokenizer.ggml.normalizer.strip_accents", lowercase)))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    # The ids the file names, else BERT's own tokens, else llama.cpp's defaults.
    cls_id = field("tokenizer.ggml.cls_token_id", field("tokenizer.ggml.bos_token_id",
                                                        vocab.get("[CLS]", 101)))
    sep_id = field("tokenizer.ggml.seperator_token_id", vocab.get("[SEP]", 102))
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _CONTROL])
    return backend


_BUILDERS: dict[str, Callable[[Field, list[str], list[int]], HFTokenizer]] = {
    "gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe, "bert": _wordpiece}


# llama.cpp's pre-tokenizers (src/llama-vocab.cpp: the name -> LLAMA_VOCAB_PRE_TYPE_* table in
# llama_vocab::impl::load, the regexes in llm_tokenizer_bpe's constructor). Where llama.cpp
# rewrote a tokenizer.json regex for std::regex (no `(?i:...)`, no \p{Lu}), this keeps the
# original it quotes: Oniguruma runs it, and it is the model's own split (the rewrites differ
# on non-ASCII letters). Names llama.cpp knows that are missing here are refused.
# llama.cpp's GPT-2 regex lacks the Hub's final `|\s+`: the one whitespace character it can
# leave unmatched (before a non-space) is a fragment of its own either way
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# a word is an optional upper-case run and a lower-case run, or an upper-case run alone
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek LLM's letters: Unicode's cased letters, as ranges (escaped: several are canonical
# singletons, e.g. U+2126 OHM SIGN, that an editor may normalize away)
_DEEPSEEK_CASED = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943")
# CJK ideographs U+4E00-9FA5, U+0800-4E00 (every script in between), Hangul syllables
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM = (r"[\r\n]", rf"\s?[{_DEEPSEEK_CASED}]+",
                 # punctuation, full-width forms, quotes U+2018-201F, U+3000-3002; its
                 # `:-~` holds A-Z and a-z too, so "école" is cut to "é" "cole" here
                 "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                 r"\s+$", _DEEPSEEK_CJK, r"\p{N}+")
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")
_DEEPSEEK_V3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",  # CJK, kana
                r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
                r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
# anything but whitespace and sentence punctuation: . , ! ? … 。 ， 、 । ۔ ،  (and ( | ))
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_CHAMELEON = (r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
              r"([\t\n]|    |  )", r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2)

PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    # what llama.cpp runs for `default` and for a file with no tokenizer.ggml.pre: GPT-2's
    # regex after punctuation runs are cut out, digit runs cut in threes from the left
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    # `gpt2` is no name llama.cpp's converter writes; accepted as GPT-2
    **dict.fromkeys(["gpt-2", "gpt2", "mpt", "olmo", "jais", "phi-2", "jina-es", "jina-de",
                     "jina-v2-es", "jina-v2-de", "gigachat", "a.x-4.0", "mellum", "exaone4",
                     "trillion", "granite-docling"], (_GPT2,)),
    **dict.fromkeys(["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                     "minerva-7b", "mellum2"], (r"\p{N}", _GPT2)),  # every digit alone
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe", "chatglm-bpe",
                     "glm4"], (_LLAMA3,)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2",
                     "hunyuan", "solar-open", "grok-2"], (_QWEN2,)),
    "qwen35": (_QWEN35,),
    "tekken": (_TEKKEN,),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], (_GPT4O,)),
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], _DEEPSEEK_V3),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], (_BLOOM,)),
    "viking": (_BLOOM, r"\p{N}"),
    "chameleon": _CHAMELEON,
}
_LLAMA3_NAMES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                 "midm-2.0", "lfm2", "jina-v5-nano"}
# llama.cpp takes a fragment the vocabulary holds whole as one token, merges or not (as
# tiktoken and Llama 3's tokenizer.json do); DBRX and Smaug share the regex, not this
_IGNORE_MERGES = _LLAMA3_NAMES | {"tekken"}
# llama.cpp adds BOS for these when the file has no tokenizer.ggml.add_bos_token
_ADD_BOS = _LLAMA3_NAMES | {"tekken", "chameleon"}
