"""Embedding models from GGUF (the files llama.cpp's and Ollama's embedding servers load):
a tiny random BERT converted as llama.cpp converts `BertModel` (tests/gguf_writer.py: the
vocabulary in "phantom space" form, the pooling type from sentence-transformers' files)
embeds as transformers does on the folder it came from, and its WordPiece vocabulary gives
the folder tokenizer's ids, uncased and cased; a decoder whose file names a pooling type
(Qwen3-Embedding's, last token) embeds by it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from pkv import LLM
from pkv.cli.bench.embed import write_random_bert
from pkv.core.model_loader.loader import open_model
from pkv.tests.gguf_writer import quantized_copy, write_gguf
from pkv.tests.helpers import build_tiny_model

SHAPE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
             vocab_size=1000, max_position_embeddings=128)
TEXTS = ["hello world", "a, b and c!", "The QUICK brown fox - w17 w18 jumps", "w999"]
CORPUS = ["Hello, World! def add(a, b): return a+b  # ok", "naïve café Ünïcödé résumé",
          "東京は晴れ 我爱你", "Привет, мир", "emoji 🙂 ok", "   spaces\tand\nnewlines  ",
          "x==y!=z<=w>=v && (a||b); [CLS] [MASK]", "The Quick brown Fox", "12345 3.14 1,000",
          "unbelievable untokenizable", ""]


def _reference(folder: Path, texts: list[str], mode: str) -> list[torch.Tensor]:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.BertModel.from_pretrained(folder).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
            out.append(F.normalize(hidden.mean(0) if mode == "mean" else hidden[0], dim=0))
    return out


@pytest.mark.parametrize("mode, quant", [("mean", "F32"), ("cls", "Q8_0"), ("mean", "F16")])
def test_gguf_bert_embeds_as_transformers(tmp_path: Path, mode: str, quant: str):
    folder = write_random_bert(tmp_path / "hf", SHAPE, mode, seed=4)
    path = write_gguf(folder, tmp_path / f"bert-{quant}.gguf", quant)
    llm = LLM(str(path), show_progress=False)  # task auto: the file names a pooling type
    outs = llm.embed(TEXTS)
    runner = llm.llm_engine.runner  # the linears and the word table in the file's blocks
    assert quant in runner.weight_bytes_by_type
    assert runner.weight_bytes <= 1.15 * path.stat().st_size
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert [o.prompt_token_ids for o in outs] == [tok(t)["input_ids"] for t in TEXTS]
    reference = folder if quant == "F32" else quantized_copy(folder, tmp_path / "ref", quant)
    for got, want in zip(outs, _reference(reference, TEXTS, mode)):
        assert float(F.cosine_similarity(got.outputs.data, want, dim=0)) >= 0.9999
        assert abs(got.outputs.data.norm().item() - 1) < 1e-5
    assert llm.llm_engine.get_stats().num_blocks_used == 0


@pytest.mark.parametrize("quant", ["F32", "F16"])
def test_gguf_bert_of_odd_width_embeds_in_float32(tmp_path: Path, quant: str):
    """Layers whose inputs are not whole 32-value blocks (a 312-wide TinyBERT's) load as
    float32, 16-bit tables included, and embed as transformers does."""
    shape = {**SHAPE, "hidden_size": 40, "intermediate_size": 72}
    folder = write_random_bert(tmp_path / "hf", shape, "mean", seed=5)
    path = write_gguf(folder, tmp_path / f"odd-{quant}.gguf", quant)
    llm = LLM(str(path), show_progress=False)
    assert set(llm.llm_engine.runner.weight_bytes_by_type) == {"float32"}
    reference = folder if quant == "F32" else quantized_copy(folder, tmp_path / "ref", quant)
    for got, want in zip(llm.embed(TEXTS), _reference(reference, TEXTS, "mean")):
        assert float(F.cosine_similarity(got.outputs.data, want, dim=0)) >= 0.9999


def _rich_vocab(cased: bool) -> list[str]:
    """1,000 WordPiece entries: BERT's specials, single characters (ASCII, accented, CJK,
    Cyrillic) and their continuations, some whole words and pieces, and filler."""
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'-()[]{}:;=<>+*#/&|\\\"_$%@^~`")
    chars += list("东京晴我爱你はれприветмир") + (list("ABCDEFGHIJKLMNOPQRSTUVWXYZÜéï")
                                              if cased else [])
    words = ["hello", "world", "def", "add", "return", "ok", "spaces", "and", "new", "lines",
             "the", "quick", "brown", "fox", "cafe", "resume", "un", "##believ", "##able",
             "##token", "##iz", "naive", "emoji", "при", "##вет", "##lines", "##s"]
    if cased:
        words += ["Hello", "World", "The", "Quick", "Fox", "café", "résumé", "naïve"]
    pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *("##" + c for c in chars),
              *words]
    pieces = list(dict.fromkeys(pieces))
    return pieces + [f"w{n}" for n in range(1000 - len(pieces))]


def _bert_folder(root: Path, cased: bool) -> Path:
    """A random BERT whose tokenizer is `_rich_vocab`'s, lowercasing unless `cased`."""
    folder = write_random_bert(root, SHAPE, "mean")
    vocab = {piece: n for n, piece in enumerate(_rich_vocab(cased))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=not cased)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["do_lower_case"] = not cased
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("cased", [False, True])
def test_gguf_wordpiece_gives_the_checkpoints_ids(tmp_path: Path, cased: bool):
    folder = _bert_folder(tmp_path / "hf", cased)
    path = write_gguf(folder, tmp_path / "bert.gguf", "F32")
    ours = open_model(str(path)).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    for text in CORPUS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == theirs(
            text, add_special_tokens=False)["input_ids"], text
    assert ours.encode("a § b", add_special_tokens=False)[1] == 1  # [UNK]: no piece spells it
    words = "the quick brown fox"
    assert ours.decode(ours.encode(words)) == theirs.decode(theirs(words)["input_ids"],
                                                            skip_special_tokens=True)


def test_a_decoder_gguf_that_names_a_pooling_type_embeds(tmp_path: Path, smol_hf_dir: Path,
                                                          smol_gguf: Path):
    import gguf

    folder = build_tiny_model(tmp_path / "hf", smol_hf_dir, "qwen3")
    path = write_gguf(folder, tmp_path / "embed.gguf", "F32", smol_gguf,
                      extra_fields={"add_pooling_type": gguf.PoolingType.LAST})
    llm = LLM(str(path), kv_cache_memory="64MiB", show_progress=False)
    assert llm.llm_engine.task == "embed"
    prompts = [[5, 17, 300, 4000], list(range(100, 160))]
    outs = llm.embed(prompts)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval().model
    with torch.no_grad():
        for out, ids in zip(outs, prompts):
            want = F.normalize(model(torch.tensor([ids])).last_hidden_state[0, -1], dim=0)
            assert float(F.cosine_similarity(out.outputs.data, want, dim=0)) >= 0.9999
    plain = write_gguf(folder, tmp_path / "plain.gguf", "F32", smol_gguf)
    assert LLM(str(plain), kv_cache_memory="64MiB", show_progress=False).llm_engine.task == \
        "generate"


def test_gguf_bert_takes_int8_activations(tmp_path: Path):
    """`awq_activations="int8"` runs the encoder's blocks with x in int8 per 32 inputs (the
    tiles' kernel): embeddings within rounding of float32 activations', not equal to them."""
    folder = write_random_bert(tmp_path / "hf", SHAPE, "mean", seed=4)
    path = write_gguf(folder, tmp_path / "bert-Q8_0.gguf", "Q8_0")
    floats = LLM(str(path), show_progress=False).embed(TEXTS)
    int8 = LLM(str(path), awq_activations="int8", show_progress=False).embed(TEXTS)
    assert any(not torch.equal(a.outputs.data, b.outputs.data) for a, b in zip(floats, int8))
    for a, b in zip(floats, int8):
        assert float(F.cosine_similarity(a.outputs.data, b.outputs.data, dim=0)) >= 0.999
