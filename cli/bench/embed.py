"""`pkv bench embed`: embedding throughput, the same inputs sent one by one and batched,
offline (`LLM.embed`) and over HTTP (`/v1/embeddings`).

One by one, each input is its own request (a step of one prompt: what a client that sends
one input at a time gets); batched, every input goes in one request, and the scheduler packs
as many prompts as the token budget allows into each step. Without a model it runs a
random-weight BERT at all-MiniLM-L6-v2's shapes (`write_random_bert`), whose tokenizer maps
each word `w<N>` to one token, so an input's length is exactly its word count (+2).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MINILM_SHAPE = dict(num_hidden_layers=6, hidden_size=384, num_attention_heads=12,
                    intermediate_size=1536, vocab_size=30522, max_position_embeddings=512)
_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_random_bert(folder: Path, shape: dict[str, Any] | None = None,
                      pooling: str | None = "mean", classifier: bool = False,
                      matryoshka: bool = False, seed: int = 0, labels: int = 1) -> Path:
    """A BERT checkpoint with random weights: config.json, model.safetensors, a WordPiece
    tokenizer, and (unless `pooling` is None) sentence-transformers' modules with that
    pooling mode and Normalize. `classifier`: a sequence classifier
    (BertForSequenceClassification) of `labels` labels (1: a cross-encoder)."""
    import torch
    from safetensors.torch import save_file

    shape = {**MINILM_SHAPE, **(shape or {})}
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["BertForSequenceClassification" if classifier else "BertModel"],
              "model_type": "bert", "hidden_act": "gelu", "layer_norm_eps": 1e-12,
              "type_vocab_size": 2, "pad_token_id": 0, "torch_dtype": "float32", **shape}
    if classifier:
        names = {str(i): f"LABEL_{i}" if labels == 1 else f"class_{i}" for i in range(labels)}
        config.update(num_labels=labels, id2label=names,
                      label2id={name: int(i) for i, name in names.items()})
    if matryoshka:
        config["is_matryoshka"] = True
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: _init(name, dims, gen)
               for name, dims in _bert_shapes(shape, labels if classifier else 0)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_wordpiece(folder, shape["vocab_size"], shape["max_position_embeddings"])
    if pooling is not None and not classifier:
        _write_st_modules(folder, pooling)
    return folder


def _init(name: str, dims: tuple[int, ...], gen: Any) -> Any:
    import torch

    if name.endswith("LayerNorm.weight"):
        return 1 + 0.1 * torch.randn(dims, generator=gen)
    return 0.05 * torch.randn(dims, generator=gen)


def _bert_shapes(s: dict[str, Any], labels: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's name and shape; `labels`: a classifier's (0: no classifier)."""
    h, i = s["hidden_size"], s["intermediate_size"]
    pre = "bert." if labels else ""
    out = [("embeddings.word_embeddings.weight", (s["vocab_size"], h)),
           ("embeddings.position_embeddings.weight", (s["max_position_embeddings"], h)),
           ("embeddings.token_type_embeddings.weight", (2, h)),
           ("embeddings.LayerNorm.weight", (h,)), ("embeddings.LayerNorm.bias", (h,))]
    for n in range(s["num_hidden_layers"]):
        layer = f"encoder.layer.{n}."
        for part, d_out, d_in in (("attention.self.query", h, h), ("attention.self.key", h, h),
                                  ("attention.self.value", h, h),
                                  ("attention.output.dense", h, h),
                                  ("intermediate.dense", i, h), ("output.dense", h, i)):
            out += [(layer + part + ".weight", (d_out, d_in)), (layer + part + ".bias", (d_out,))]
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            out += [(layer + norm + ".weight", (h,)), (layer + norm + ".bias", (h,))]
    out += [("pooler.dense.weight", (h, h)), ("pooler.dense.bias", (h,))]
    out = [(pre + name, dims) for name, dims in out]
    if labels:
        out += [("classifier.weight", (labels, h)), ("classifier.bias", (labels,))]
    return out


def _write_wordpiece(folder: Path, vocab_size: int, max_len: int) -> None:
    """BERT's tokenizer pipeline (lowercasing normalizer, BERT pre-tokenizer, WordPiece,
    [CLS] a [SEP] b [SEP]) over specials, letters, digits and the words w0, w1, ..."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'-")
    pieces = _SPECIALS + chars + ["##" + c for c in chars]
    pieces += [f"w{n}" for n in range(vocab_size - len(pieces))]
    vocab = {piece: n for n, piece in enumerate(pieces)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(_SPECIALS)  # listed as added tokens too, as BERT's own files do
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": True,
              "model_max_length": max_len, **{k: v for k, v in zip(
                  ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), _SPECIALS)}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _write_st_modules(folder: Path, pooling: str) -> None:
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    flags = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
             "last": "pooling_mode_lasttoken"}
    config = {"word_embedding_dimension": 0, **{flag: mode == pooling
                                                for mode, flag in flags.items()}}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2))


def random_inputs(count: int, min_words: int, max_words: int, seed: int = 0) -> list[str]:
    """`count` texts of `min_words`..`max_words` random vocabulary words."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(20000)}" for _ in range(rng.randint(min_words, max_words)))
            for _ in range(count)]


@dataclass(slots=True)
class EmbedRun:
    """One way of sending the inputs, timed."""

    name: str
    inputs: int
    tokens: int
    seconds: float

    @property
    def inputs_per_s(self) -> float:
        return self.inputs / self.seconds


Embedder = Callable[[list[str]], int]  # embeds the texts in one request; returns their tokens


def one_by_one_vs_batched(embed: Embedder, inputs: list[str], repeats: int,
                          where: str) -> list[EmbedRun]:
    """One request per input, then one request of them all, `repeats` times alternating (a
    noisy machine drifts alike for both); the best time of each."""
    embed(inputs[:4])  # warm-up: first-touch allocations, kernel choice
    best: dict[str, EmbedRun] = {}
    for _ in range(repeats):
        for name, batches in (("one by one", [[t] for t in inputs]), ("batched", [inputs])):
            start = time.perf_counter()
            tokens = sum(embed(batch) for batch in batches)
            run = EmbedRun(f"{where}, {name}", len(inputs), tokens, time.perf_counter() - start)
            if name not in best or run.seconds < best[name].seconds:
                best[name] = run
    return [best["one by one"], best["batched"]]


def run_embed_bench(model: str | None, num_inputs: int, min_words: int, max_words: int,
                    repeats: int, seed: int) -> dict[str, Any]:
    """The runs of `pkv bench embed` on `model` or a random MiniLM-shaped BERT: offline
    (`LLM.embed`), then over HTTP (`/v1/embeddings` of a `pkv serve` on loopback)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pkv-bench-embed-") as tmp:
        path = model or str(write_random_bert(Path(tmp) / "minilm-random", seed=seed))
        inputs = random_inputs(num_inputs, min_words, max_words, seed)
        runs, budget = _offline_runs(path, inputs, repeats)
        runs += _server_runs(path, inputs, repeats)
    return {"model": model or "random BERT, all-MiniLM-L6-v2's shapes", "token_budget": budget,
            "runs": [{**asdict(r), "inputs_per_s": r.inputs_per_s} for r in runs],
            "speedup_offline": runs[0].seconds / runs[1].seconds,
            "speedup_server": runs[2].seconds / runs[3].seconds}


def _offline_runs(path: str, inputs: list[str], repeats: int) -> tuple[list[EmbedRun], int]:
    from pkv.core.engine.llm import LLM

    llm = LLM(path, show_progress=False)
    if llm.llm_engine.task != "embed":
        raise ValueError(f"{path} is not an embedding model (it serves "
                         f"task={llm.llm_engine.task})")

    def embed(texts: list[str]) -> int:
        return sum(len(o.prompt_token_ids) for o in llm.embed(texts, use_tqdm=False))

    runs = one_by_one_vs_batched(embed, inputs, repeats, "offline")
    budget = llm.llm_engine.max_num_batched_tokens
    llm.shutdown()
    return runs, budget


def _server_runs(path: str, inputs: list[str], repeats: int) -> list[EmbedRun]:
    import secrets

    import httpx

    from pkv.cli.serve_process import start_pkv_serve

    key = secrets.token_hex(8)
    with start_pkv_serve([path], key) as (base, _), httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=300) as client:
        def embed(texts: list[str]) -> int:
            r = client.post("/v1/embeddings", json={"input": texts})
            r.raise_for_status()
            return r.json()["usage"]["prompt_tokens"]

        return one_by_one_vs_batched(embed, inputs, repeats, "server")


def embed_table(result: dict[str, Any]) -> Any:
    from rich.table import Table

    runs = result["runs"]
    table = Table(title=f"embeddings: {runs[0]['inputs']} inputs, {runs[0]['tokens']} tokens, "
                        f"{result['model']} (token budget {result['token_budget']})")
    for column in ("requests", "seconds", "inputs/s", "tokens/s"):
        table.add_column(column, justify="right" if column != "requests" else "left")
    for r in runs:
        table.add_row(r["name"], f"{r['seconds']:.3f}", f"{r['inputs_per_s']:.1f}",
                      f"{r['tokens'] / r['seconds']:.0f}")
    table.caption = (f"batched / one by one: offline {result['speedup_offline']:.2f}x, server "
                     f"{result['speedup_server']:.2f}x (target >= 3x)")
    return table
