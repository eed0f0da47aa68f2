"""Byte-level BPE GGUF tokenizers (`tokenizer.ggml.model == "gpt2"`) split text as their
`tokenizer.ggml.pre` says, with llama.cpp's regexes for that name.

- Against transformers: for every name whose split transformers' GGUF conversion knows (its
  own table: Llama 3, Qwen2, Qwen3.5, Tekken, GPT-4o, and GPT-2's regex for names it does
  not list), a GGUF with that `pre` encodes a mixed corpus to the ids of
  `AutoTokenizer.from_pretrained(dir, gguf_file=...)`. Names llama.cpp runs with the same
  regex as one of those (ChatGLM's, StableLM 2's, ...) are checked against that reference.
- By hand: names transformers splits GPT-2 style though llama.cpp does not (digits alone,
  DeepSeek, Falcon, BLOOM, Chameleon, `default`) cut a few strings into the fragments their
  regexes give, worked out from llama.cpp's regex list, not from running pkv.
- llama.cpp's other per-name choices: whole-token lookup before merges (Llama 3, Tekken),
  BOS added when the file does not say (Llama 3, Tekken, Chameleon), `default` for a file
  without `pre`, and an unknown name refused in one line.

No network. The vocabulary is trained here, byte-level BPE with no split at all, on pkv's
calibration text and the corpus: its merges cross words, punctuation, digits and newlines,
so splits that differ give different ids (checked: no two of the table's splits encode the
corpus alike).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from pkv.core.tokenizer.tokenizer import Tokenizer
from pkv.plugins.weights.gguf import GGUFFile
from pkv.plugins.weights.gguf_tokenizer import PRE_TOKENIZER_SPLITS, gguf_tokenizer
from pkv.tests.gguf_writer import write_fields_gguf

CALIBRATION = Path(__file__).parents[2] / "quantize" / "data" / "calibration.txt"
NORMAL, CONTROL = 1, 3
EOT = "<|endoftext|>"
CORPUS = [
    "def mean(arr):\n    return sum(arr) / len(arr)  # (arr) is a list\n",
    "if (arr.length > 0) { for (let i = 0; i < n; i++) { total += arr[i]; } }\n",
    "the 21-th item:\nthe 3-th one:\n\n\nkey: value\r\nnext:\tvalue",
    "Wait!!! What?!... Well -- ok;;; (((nested))) [[x]] {{y}} <<<>>> ***bold*** ~~~ a`b`c",
    "Pi 3.14159265358979, 1234567890123 and 42 / 1,000,000 at 2024-05-17T12:34:56 x 12",
    "  leading\ttab\t\tand   runs    of     spaces\r\nwindows\r\n\n  \n end   ",
    "日本語のテキストと中文字符，还有한국어 문장도 있습니다。カタカナ",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "emoji 🙂🚀👍🏽 family 👨\u200d👩\u200d👧 flag 🇨🇦 and ✨sparkles✨",
    "I'll say it's John's; they're sure we've, I'm, he'd. DON'T SHOUT, I'LL WAIT. It’s",
    "HTTPServer iPhone McDonald camelCaseWord snake_case ALLCAPS ÉCOLE école naïve café",
    "marks e\u0301 n\u0303; नमस्ते दुनिया; مرحبا بالعالم، كيف؟ Ελληνικά ΣΟΦΙΑ",
    "non\u00a0breaking\u3000wide space … ellipsis — dash ½ ² Ⅻ ٣٤٥ ¿qué? «quote»",
    f"<sentinel:12> IMGIMGABZ <|endoftext|> after {EOT}",
    "", " ", "\n", "x", "12", "'s",
]

# llama.cpp's names by split (src/llama-vocab.cpp), written out here apart from pkv's table
LLAMA3 = ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
          "lfm2", "jina-v5-nano"]
GPT2 = ["gpt-2", "gpt2", "mpt", "olmo", "jais", "phi-2", "jina-es", "jina-de", "jina-v2-es",
        "jina-v2-de", "gigachat", "a.x-4.0", "mellum", "exaone4", "trillion", "granite-docling"]
QWEN2 = ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"]
GPT4O = ["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"]
# name -> the name of transformers' reference with the same llama.cpp regex
SAME_REGEX = {"dbrx": "llama-bpe", "smaug-bpe": "llama-bpe", "chatglm-bpe": "llama-bpe",
              "glm4": "llama-bpe", "stablelm2": "qwen2", "hunyuan": "qwen2",
              "solar-open": "qwen2", "grok-2": "qwen2"}
IGNORE_MERGES = {*LLAMA3, "tekken"}  # llama.cpp's ignore_merges = true
# transformers' reference name -> the GGUF architecture written beside it
ARCH = {**dict.fromkeys(GPT2, "gpt2"), **dict.fromkeys(LLAMA3 + GPT4O + ["tekken"], "llama"),
        **dict.fromkeys(QWEN2 + ["qwen35"], "qwen2")}
CHECKED_BY_TRANSFORMERS = [*GPT2, *LLAMA3, *QWEN2, "qwen35", "tekken", *GPT4O, *SAME_REGEX]


@dataclass(slots=True)
class ByteLevelVocab:
    tokens: list[str]  # a control token EOT last
    merges: list[str]


@pytest.fixture(scope="module")
def vocab() -> ByteLevelVocab:
    """~3000 tokens, byte-level BPE trained with no split (see the module docstring)."""
    trainer_model = HFTokenizer(models.BPE())
    trainer_model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                           use_regex=False)
    text = CALIBRATION.read_text()
    chunks = [text[i:i + 400] for i in range(0, len(text), 400)] + CORPUS * 3
    trainer_model.train_from_iterator(chunks, trainers.BpeTrainer(
        vocab_size=3000, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    state = json.loads(trainer_model.to_str())["model"]
    tokens = [t for t, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    return ByteLevelVocab([*tokens, EOT], merges)


def write_tokenizer_gguf(path: Path, vocab: ByteLevelVocab, pre: str | None,
                         arch: str = "llama") -> Path:
    """A GGUF holding only tokenizer metadata, as llama.cpp's converter writes it."""
    fields: dict[str, Any] = {"add_tokenizer_model": "gpt2"}
    if pre is not None:
        fields["add_tokenizer_pre"] = pre
    last = len(vocab.tokens) - 1  # the end-of-text token, control
    fields |= {"add_token_list": vocab.tokens,
               "add_token_types": [NORMAL] * last + [CONTROL],
               "add_token_merges": vocab.merges, "add_bos_token_id": last,
               "add_eos_token_id": last}
    return write_fields_gguf(path, arch, fields)


def fields_tokenizer(vocab: ByteLevelVocab, pre: str | None, **fields: Any) -> Tokenizer:
    """pkv's tokenizer from metadata held in a dict (no file)."""
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": vocab.tokens,
            "tokenizer.ggml.token_type": [NORMAL] * (len(vocab.tokens) - 1) + [CONTROL],
            "tokenizer.ggml.merges": vocab.merges, **fields}
    return gguf_tokenizer(lambda key, default=None: meta.get(key, default))


def fragments(tok: Tokenizer, text: str) -> list[str]:
    """The pieces pkv's pre-tokenizer cuts `text` into, as text (GPT-2's alphabet undone)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    return [bytes(to_byte[c] for c in piece).decode()
            for piece, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]


def test_every_name_is_checked_and_compiles():
    checked = {*CHECKED_BY_TRANSFORMERS, *(name for names, _ in HAND_SPLITS.values()
                                           for name in names)}
    assert checked == set(PRE_TOKENIZER_SPLITS)
    for name in PRE_TOKENIZER_SPLITS:  # every regex compiles in Oniguruma
        fields_tokenizer(ByteLevelVocab(["a", EOT], []), name)


def test_the_corpus_tells_every_split_apart(vocab: ByteLevelVocab):
    # else a name given another name's split could still encode the corpus to the same ids
    text = "\n".join(CORPUS)
    splits = {regexes: name for name, regexes in PRE_TOKENIZER_SPLITS.items()}  # a name each
    ids = {tuple(fields_tokenizer(vocab, name).encode(text, False)) for name in splits.values()}
    assert len(ids) == len(splits) > 10


@pytest.mark.parametrize("name", CHECKED_BY_TRANSFORMERS)
def test_ids_are_transformers_ids(name: str, tmp_path: Path, vocab: ByteLevelVocab):
    from transformers import AutoTokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_PRE_TOKENIZER_SPLITS as HF_SPLITS,
    )

    ref_name = SAME_REGEX.get(name, name)
    # transformers falls back to GPT-2's regex for a name its table lacks
    assert (ref_name in HF_SPLITS) == (ref_name not in GPT2), ref_name
    ref_path = write_tokenizer_gguf(tmp_path / "ref.gguf", vocab, ref_name, ARCH[ref_name])
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=ref_path.name)
    # transformers' GGUF conversion drops llama.cpp's whole-token lookup (the Hub's Llama 3
    # tokenizer.json has it); set as llama.cpp sets it for `name`
    ref.backend_tokenizer.model.ignore_merges = name in IGNORE_MERGES
    arch = "qwen2" if ARCH[ref_name] == "qwen2" else "llama"  # one pkv runs
    path = write_tokenizer_gguf(tmp_path / f"{name}.gguf", vocab, name, arch)
    tok = GGUFFile(path).tokenizer()
    for text in [*CORPUS, "\n".join(CORPUS)]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text


# split -> (llama.cpp's names for it, {text: the fragments its regexes cut it into})
HAND_SPLITS: dict[str, tuple[list[str], dict[str, list[str]]]] = {
    # punctuation runs cut out first, then GPT-2, then numbers, then digits in threes
    "default": (["default"], {
        "Hi, it's 12345+6!": ["Hi", ",", " it", "'", "s", " ", "123", "45", "+", "6", "!"],
        "x 12": ["x", " ", "12"],
        "`(": ["`", "("]}),
    "falcon": (["falcon"], {
        "Hi, it's 12345+6!": ["Hi", ",", " it", "'", "s", " ", "123", "45", "+", "6", "!"],
        "x 12": ["x", " 12"],
        "`(": ["`("]}),
    "digits": (["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                "minerva-7b", "mellum2"], {
        "Hi, it's 12345+6!": ["Hi", ",", " it", "'s", " ", "1", "2", "3", "4", "5", "+", "6",
                              "!"],
        "x = f(arr)\nthe 5-th:\n": ["x", " =", " f", "(", "arr", ")", "\n", "the", " ", "5",
                                   "-", "th", ":", "\n"]}),
    "gpt-2": (["gpt-2", "mpt", "olmo", "jais"], {
        "x = f(arr)\nthe 5-th:\n": ["x", " =", " f", "(", "arr", ")", "\n", "the", " 5", "-",
                                   "th", ":", "\n"]}),
    "qwen2": (QWEN2 + ["stablelm2", "hunyuan", "solar-open", "grok-2"], {
        "x = f(arr)\nthe 5-th:\n": ["x", " =", " f", "(arr", ")\n", "the", " ", "5", "-th",
                                   ":\n"]}),
    "deepseek-llm": (["deepseek-llm"], {
        "Hello, World!\n日本 2024年": ["Hello", ",", " World", "!", "\n", "日本", " ", "2024",
                                      "年"],
        # its punctuation class `:-~` holds the ASCII letters too
        "ÉCOLE école": ["É", "COLE", " é", "cole"]}),
    "deepseek-coder": (["deepseek-coder"], {
        "x = foo(12);\n  日本語": ["x", " =", " foo", "(", "1", "2", ");", "\n", " ", " ",
                                 "日本語"]}),
    "deepseek-v3": (["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], {
        "abc 12345 日本語のテキスト!\n\n(arr": ["abc", " ", "123", "45", " ", "日本語のテキスト",
                                          "!\n\n", "(arr"]}),
    "bloom": (["bloom", "poro-chat", "gpt3-finnish"], {
        "Hello, world! (arr)-th:\n  x…y": ["Hello", ",", " world", "! (", "arr", ")", "-th:",
                                          "\n ", " x", "…", "y"],
        "a 123": ["a", " 123"]}),
    "viking": (["viking"], {"a 123": ["a", " ", "1", "2", "3"]}),
    "chameleon": (["chameleon"], {
        "<sentinel:12>IMGIMGABZ Hi, 42\n  x": ["<", "sentinel", ":", "1", "2", ">", "IMGIMGABZ",
                                              " Hi", ",", " ", "4", "2", "\n", "  ", "x"]}),
}


@pytest.mark.parametrize("split", HAND_SPLITS)
def test_splits_worked_out_by_hand(split: str, vocab: ByteLevelVocab):
    names, cases = HAND_SPLITS[split]
    for name in names:
        tok = fields_tokenizer(vocab, name)
        for text, expected in cases.items():
            assert fragments(tok, text) == expected, (name, text)


def test_no_pre_is_llama_cpps_default(tmp_path: Path, vocab: ByteLevelVocab):
    # llama.cpp warns and runs `default`, which is not GPT-2's split
    old = GGUFFile(write_tokenizer_gguf(tmp_path / "old.gguf", vocab, None)).tokenizer()
    default = fields_tokenizer(vocab, "default")
    text = "\n".join(CORPUS)
    assert old.encode(text) == default.encode(text)
    assert old.encode(text) != fields_tokenizer(vocab, "gpt-2").encode(text)
    assert fragments(old, "x 12") == ["x", " ", "12"]


def test_unknown_pre_is_refused_in_one_line(vocab: ByteLevelVocab):
    with pytest.raises(ValueError) as err:
        fields_tokenizer(vocab, "qwen-next-tokenizer")
    message = str(err.value)
    assert "\n" not in message and "'qwen-next-tokenizer'" in message
    assert all(name in message for name in ("qwen2", "llama-bpe", "smollm", "deepseek-llm"))


def test_whole_token_before_merges():
    # "abc" is in the vocabulary, but merging pairs by rank makes "ab" "c": llama.cpp takes
    # the whole token for Llama 3 and Tekken, and merges for the rest (DBRX shares the regex)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tiny = ByteLevelVocab([*bytes_to_unicode().values(), "ab", "bc", "abc", EOT],
                          ["a b", "b c", "a bc"])
    ids = {t: i for i, t in enumerate(tiny.tokens)}
    for name in ["llama-bpe", "llama3", "tekken", "dbrx", "qwen2", "gpt-2"]:
        whole = name in IGNORE_MERGES
        expected = [ids["abc"]] if whole else [ids["ab"], ids["c"]]
        assert fields_tokenizer(tiny, name).encode("abc", False) == expected, name


@pytest.mark.parametrize("name,written,adds", [
    ("llama-bpe", None, True), ("tekken", None, True), ("chameleon", None, True),
    ("llama-bpe", False, False), ("qwen2", None, False), ("gpt-2", None, False),
    ("qwen2", True, True)])
def test_bos_when_the_file_does_not_say(name: str, written: bool | None, adds: bool,
                                        vocab: ByteLevelVocab):
    fields = {} if written is None else {"tokenizer.ggml.add_bos_token": written}
    tok = fields_tokenizer(vocab, name, **{"tokenizer.ggml.bos_token_id": len(vocab.tokens) - 1},
                           **fields)
    assert (tok.encode("hi")[:1] == [len(vocab.tokens) - 1]) == adds


@pytest.mark.parametrize("written", [None, False, True])
def test_eos_where_the_file_says(written: bool | None, vocab: ByteLevelVocab):
    # Qwen3-Embedding's files say add_eos_token: last-token pooling reads the EOS.
    eos = len(vocab.tokens) - 1
    fields = {} if written is None else {"tokenizer.ggml.add_eos_token": written}
    tok = fields_tokenizer(vocab, "qwen2", **{"tokenizer.ggml.eos_token_id": eos}, **fields)
    plain = tok.encode("hi there", add_special_tokens=False)
    assert eos not in plain
    assert tok.encode("hi there") == (plain + [eos] if written else plain)
