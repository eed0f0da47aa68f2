"""SentencePiece GGUF tokenizers (`tokenizer.ggml.model == "llama"`: Llama 2, Mistral, Phi-3,
Gemma): the tokenizer pkv builds from the metadata encodes and decodes as a Hugging Face
tokenizer.json of the same vocabulary (Llama 2's layout: Prepend / Replace normalizer, BPE with
byte fallback, Replace / ByteFallback / Fuse / Strip decoder), with and without the space
prefix (Llama / Gemma), from listed merges and from scores; a tiny Llama and a tiny Gemma 2
GGUF with that tokenizer load in pkv and decode greedily as transformers on the HF folder;
the byte-level (`gpt2`) path still encodes the bundled SmolLM2 as transformers does.

No network: the vocabulary is trained here with `tokenizers` on pkv's calibration text and laid
out as a SentencePiece model is (<unk> <s> </s>, 256 byte pieces, merged pieces scored by merge
order, single characters, then added tokens as llama.cpp's converter writes them), so accented,
CJK and emoji characters fall back to bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from pkv import LLM, SamplingParams
from pkv.core.model_loader.loader import open_model
from pkv.core.tokenizer.tokenizer import Tokenizer
from pkv.plugins.weights.gguf import GGUFFile
from pkv.plugins.weights.gguf_tokenizer import merges_from_scores
from pkv.tests.gguf_writer import write_fields_gguf, write_gguf
from pkv.tests.helpers import build_tiny_model, hf_greedy

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
CALIBRATION = Path(__file__).parents[2] / "quantize" / "data" / "calibration.txt"
# after the trained pieces, as llama.cpp's converter writes added tokens (score -1000)
ADDED = [("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL), ("<think>", USER_DEFINED),
         ("\n\n", USER_DEFINED), ("<unused0>", UNUSED)]
PLAIN_TEXTS = [
    "Hello world", "The capital of Canada is Ottawa.", " leading space", "trailing space ",
    "  two leading", "multiple   inner    spaces", "", " ", "line one\nline two\n",
    "\ttab and\r\ncarriage return", "digits 1234567890 and 8,849 meters",
    "café naïve résumé", "日本語のテキスト", "emoji 🙂🚀 mixed", "Ωmega ß ~|^{}`",
    "<unused0> is no special token", "boils\n\n",
]
LINES = CALIBRATION.read_text().splitlines()[300:340]  # text the vocabulary was not trained on
SPECIAL_TEXTS = [
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "a<think>b</think> c", "<s>bos in text</s>", "<unk> in text", "one\n\n\ntwo\n\nthree",
]


@dataclass(slots=True)
class SentencePieceVocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    trained_merges: list[tuple[str, str]]

    def ids(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokens)}


@pytest.fixture(scope="session")
def spm() -> SentencePieceVocab:
    """A ~600-piece SentencePiece-BPE vocabulary trained on calibration.txt."""
    import json

    trainer_model = HFTokenizer(models.BPE())
    trainer_model.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    trainer_model.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=True)
    lines = CALIBRATION.read_text().splitlines()[:300]
    trainer_model.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=350,
                                                                 show_progress=False))
    state = json.loads(trainer_model.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in state["merges"]]
    pieces = [a + b for a, b in merges]
    alphabet = [t for t, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1])
                if t not in set(pieces)]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces,
              *alphabet, *(t for t, _ in ADDED)]
    scores = ([0.0] * 259 + [-float(i) for i in range(len(pieces) + len(alphabet))]
              + [-1000.0] * len(ADDED))
    types = ([UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (len(pieces) + len(alphabet))
             + [k for _, k in ADDED])
    assert len(set(tokens)) == len(tokens) == len(scores) == len(types)
    return SentencePieceVocab(tokens, scores, types, merges)


def scored_merges(spm: SentencePieceVocab) -> list[tuple[str, str]]:
    """The merges Hugging Face's converter derives from the pieces' scores."""
    from transformers.tokenization_utils_base import generate_merges

    return generate_merges(spm.ids(), dict(zip(spm.tokens, spm.scores)))


def reference(spm: SentencePieceVocab, merges: list[tuple[str, str]],
              prefix: bool, rstrip: frozenset[str] = frozenset()) -> HFTokenizer:
    """A tokenizer.json as Hugging Face's converter writes one for a SentencePiece BPE model
    (`rstrip`: special tokens that take the whitespace after them, as Phi-3's)."""
    tok = HFTokenizer(models.BPE(spm.ids(), merges, unk_token="<unk>", fuse_unk=True,
                                 byte_fallback=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPACE)] * prefix + [normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + [decoders.Strip(content=" ", left=1, right=0)] * prefix)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=t in rstrip)
                            for t, k in zip(spm.tokens, spm.types) if k in (UNKNOWN, CONTROL)])
    tok.add_tokens([AddedToken(t, normalized=False)
                    for t, k in zip(spm.tokens, spm.types) if k == USER_DEFINED])
    return tok


def gguf_fields(spm: SentencePieceVocab, prefix: bool | None, model: str = "llama",
                merges: list[tuple[str, str]] | None = None, **extra: Any) -> dict[str, Any]:
    """GGUFWriter method -> value, as llama.cpp's converter writes a SentencePiece vocabulary;
    `prefix` None leaves add_space_prefix and add_bos_token out (older files)."""
    fields: dict[str, Any] = {
        "add_tokenizer_model": model, "add_tokenizer_pre": "default",
        "add_token_list": spm.tokens, "add_token_scores": spm.scores,
        "add_token_types": spm.types, "add_bos_token_id": 1, "add_eos_token_id": 2,
        "add_unk_token_id": 0}
    if prefix is not None:
        fields.update(add_add_bos_token=True, add_add_eos_token=False,
                      add_add_space_prefix=prefix)
    if merges is not None:
        fields["add_token_merges"] = [f"{a} {b}" for a, b in merges]
    fields.update(extra)
    return fields


def gguf_tokenizer(path: Path, fields: dict[str, Any]) -> Tokenizer:
    """pkv's tokenizer of a GGUF holding only tokenizer metadata."""
    return GGUFFile(write_fields_gguf(path, "llama", fields)).tokenizer()


def test_phi3_chat_markers_take_the_whitespace_after_them(tmp_path: Path,
                                                         spm: SentencePieceVocab):
    # Phi-3's tokenizer.json: every special token but <unk>, <s> and <|endoftext|> rstrips
    markers = frozenset({"</s>", "<start_of_turn>", "<end_of_turn>"})
    ref = reference(spm, scored_merges(spm), True, rstrip=markers)
    path = write_fields_gguf(tmp_path / "phi3.gguf", "phi3", gguf_fields(spm, True))
    tok = GGUFFile(path).tokenizer()
    texts = SPECIAL_TEXTS + ["<start_of_turn>user\n  Hi<end_of_turn>\n\n<start_of_turn>model"]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text).ids, text
    plain = reference(spm, scored_merges(spm), True)
    assert any(plain.encode(t).ids != ref.encode(t).ids for t in texts)  # (it tells them apart)


def test_merges_from_scores_are_the_hf_converters(spm: SentencePieceVocab):
    assert merges_from_scores(spm.tokens, spm.scores, spm.ids()) == scored_merges(spm)


# case -> (add_space_prefix as written, as meant, merges written to the file)
CASES = {"llama": (True, True, False), "gemma": (False, False, False),
         "listed-merges": (True, True, True), "no-flags": (None, True, False)}


@pytest.mark.parametrize("case", CASES)
def test_encode_decode_as_reference(case: str, tmp_path: Path, spm: SentencePieceVocab):
    written, prefix, listed = CASES[case]
    merges = spm.trained_merges if listed else scored_merges(spm)
    ref = reference(spm, merges, prefix)
    # with merges, the scores llama.cpp's converter writes from a tokenizer.json: all -1000
    flat = [-1000.0] * len(spm.tokens)
    extra = dict(merges=merges, add_token_scores=flat) if listed else {}
    tok = gguf_tokenizer(tmp_path / "tok.gguf", gguf_fields(spm, written, **extra))
    assert tok.vocab_size == len(spm.tokens) and tok.add_bos_token
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, {2})
    ids = spm.ids()
    assert tok.special_token_ids == {ids[t] for t in ("<unk>", "<s>", "</s>", "<start_of_turn>",
                                                      "<end_of_turn>")}
    for text in PLAIN_TEXTS + SPECIAL_TEXTS + LINES:
        expected = ref.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_special_tokens=False) == expected, text
        # pkv adds BOS unless the text already starts with one
        assert tok.encode(text) == ([] if expected[:1] == [1] else [1]) + expected, text
        for skip in (True, False):
            assert tok.decode(expected, skip) == ref.decode(expected, skip), text
    if listed:  # the listed merges, not the scores, decided
        scored = reference(spm, scored_merges(replace(spm, scores=flat)), prefix)
        assert any(scored.encode(t).ids != ref.encode(t).ids for t in PLAIN_TEXTS + LINES)
    for text in PLAIN_TEXTS:
        if "\n\n" not in text:  # text after a user-defined token gets the space prefix too
            assert tok.decode(tok.encode(text)) == text


def test_pieces_spelled_out(tmp_path: Path, spm: SentencePieceVocab):
    # independent of the reference: the pieces llama.cpp makes of these strings
    for prefix in (True, False):
        tok = gguf_tokenizer(tmp_path / f"tok-{prefix}.gguf", gguf_fields(spm, prefix))
        pieces = lambda text: [tok.id_to_token(i) for i in tok.encode(text, False)]  # noqa: E731
        lead = [SPACE] if prefix else []
        assert pieces("é\n") == [*lead, "<0xC3>", "<0xA9>", "<0x0A>"]
        assert pieces("🙂") == [*lead, "<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
        assert "".join(pieces("x  y")) == "".join(lead) + f"x{SPACE}{SPACE}y"
        turn = pieces("<start_of_turn>model")
        assert turn[0] == "<start_of_turn>" and turn[1].startswith(SPACE) == prefix
        # a user-defined token is matched whole; the text after it is prefixed again
        think = pieces("a<think>b")
        at = think.index("<think>")
        assert ["".join(think[:at]), "".join(think[at + 1:])] == ["".join(lead) + "a",
                                                                  "".join(lead) + "b"]
        assert "<unused0>" not in pieces("<unused0>")  # unused: no added token
        assert tok.decode(tok.encode("  spaced  out  ", False)) == "  spaced  out  "


def test_chat_template_and_end_of_turn(tmp_path: Path, spm: SentencePieceVocab):
    template = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
                "{% endif %}")
    ids = spm.ids()
    tok = gguf_tokenizer(tmp_path / "chat.gguf",
                         gguf_fields(spm, False, add_chat_template=template,
                                     add_eot_token_id=ids["<end_of_turn>"]))
    assert tok.eos_token_ids == {2, ids["<end_of_turn>"]}
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tok.encode(prompt)[:2] == [1, ids["<start_of_turn>"]]


@pytest.mark.parametrize("model", ["t5", "rwkv", "plamo2"])
def test_other_tokenizer_models_are_refused_in_one_line(model: str, tmp_path: Path,
                                                        spm: SentencePieceVocab):
    with pytest.raises(ValueError) as err:
        gguf_tokenizer(tmp_path / "other.gguf", gguf_fields(spm, True, model=model))
    message = str(err.value)
    assert "\n" not in message and repr(model) in message and "'llama'" in message


@pytest.mark.parametrize("edit, message", [
    ({"add_token_merges": None}, "without tokenizer.ggml.merges"),
    ({"add_token_merges": ["nospace"]}, "tokenizer.ggml.merges holds 'nospace'"),
    ({"add_token_merges": ["zzzq zzzw"]}, "holds 'zzzq zzzw', not two tokens of the vocabulary"),
    ({"add_token_list": []}, "tokenizer.ggml.tokens is missing"),
])
def test_a_broken_byte_level_vocabulary_is_one_line(edit: dict[str, Any], message: str,
                                                    tmp_path: Path, smol_gguf: Path):
    from pkv.tests.gguf_writer import _tokenizer_fields

    fields = {k: v for k, v in {**_tokenizer_fields(str(smol_gguf)), **edit}.items()
              if v is not None}  # None: the key left out
    if not fields["add_token_list"]:
        fields["add_token_types"] = []
    with pytest.raises(ValueError) as err:
        gguf_tokenizer(tmp_path / "broken.gguf", fields)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_byte_level_gguf_still_encodes_as_transformers(smol_gguf: Path):
    # the `gpt2` builder moved to gguf_tokenizer.py; the bundled SmolLM2 is one
    from transformers import AutoTokenizer

    tok = GGUFFile(smol_gguf).tokenizer()
    hf_tok = AutoTokenizer.from_pretrained(smol_gguf.parent, gguf_file=smol_gguf.name)
    chat = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    for text in PLAIN_TEXTS + LINES + [chat]:
        assert tok.encode(text) == hf_tok.encode(text), text
    assert hf_tok.eos_token_id in tok.eos_token_ids


GEMMA2 = dict(head_dim=32, sliding_window=8, num_hidden_layers=3, tie_word_embeddings=True,
              query_pre_attn_scalar=32, attn_logit_softcapping=0.5, final_logit_softcapping=5.0)
PROMPTS = ["The capital of Canada is", "Water boils at 100 degrees Celsius",
           "  café 日本 🙂\nnext line"]
NEW_TOKENS = 12


@pytest.mark.parametrize("family,prefix,overrides", [("llama", True, {}),
                                                     ("gemma2", False, GEMMA2)])
def test_tiny_model_gguf_generates_as_transformers(family: str, prefix: bool,
                                                   overrides: dict[str, Any], tmp_path: Path,
                                                   spm: SentencePieceVocab):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = reference(spm, scored_merges(spm), prefix)
    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    ref.save(str(tok_dir / "tokenizer.json"))
    model_dir = build_tiny_model(tmp_path / "hf", tok_dir, family, vocab_size=len(spm.tokens),
                                 **overrides)
    gguf_path = write_gguf(model_dir, tmp_path / f"{family}.gguf", "F32",
                           tokenizer_fields=gguf_fields(spm, prefix))
    prompt_ids = [[1, *ref.encode(p, add_special_tokens=False).ids] for p in PROMPTS]

    llm = LLM(str(gguf_path), block_size=4, kv_cache_memory="16MiB", show_progress=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    llm.llm_engine.shutdown()
    assert [o.prompt_token_ids for o in outs] == prompt_ids
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    expected = hf_greedy(hf, prompt_ids, NEW_TOKENS, 2)
    assert any(len(e) == NEW_TOKENS for e in expected)  # the reference really decoded
    assert [o.outputs[0].token_ids for o in outs] == expected
    texts = [ref.decode(tokens) for tokens in expected]
    assert [llm.get_tokenizer().decode(tokens) for tokens in expected] == texts
    # streamed text, where the random model's byte pieces happen to make valid UTF-8
    valid = [(o.outputs[0].text, text) for o, text in zip(outs, texts) if "\ufffd" not in text]
    assert valid and all(streamed == text for streamed, text in valid)

    # the file opened again (no engine) gives the same tokenizer
    reopened = open_model(str(gguf_path)).tokenizer
    assert [reopened.encode(p) for p in PROMPTS] == prompt_ids
    assert reopened.decode(expected[0]) == ref.decode(expected[0])
    if family == "llama":
        # transformers reading the same GGUF agrees on text without added tokens, but for a
        # leading space: its Metaspace adds no ▁ there, SentencePiece and llama.cpp do.
        hf_tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        for text in PLAIN_TEXTS:
            if "\n\n" not in text and not text.startswith(" "):
                assert hf_tok.encode(text) == reopened.encode(text), text
