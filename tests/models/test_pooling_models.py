"""Pooling models against transformers on the same weights: BERT encoders (mean and CLS
pooling from sentence-transformers' files), a BERT cross-encoder, and decoders used as
embedding models (saved headless as `Qwen3Model`, or a causal LM run with task=embed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from pkv import LLM, PoolingParams, SamplingParams
from pkv.cli.bench.embed import write_random_bert
from pkv.tests.helpers import save_headless_qwen3

SHAPE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
             vocab_size=1000, max_position_embeddings=128)
TEXTS = ["hello world", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12", "a, b and c!", "w999",
         "The QUICK brown fox - w17 w18 jumps"]


@pytest.fixture(scope="module")
def bert_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bert")
    return {"mean": write_random_bert(root / "mean", SHAPE, "mean", matryoshka=True),
            "cls": write_random_bert(root / "cls", SHAPE, "cls", seed=1),
            "plain": write_random_bert(root / "plain", SHAPE, None, seed=2),
            "cross": write_random_bert(root / "cross", SHAPE, classifier=True, seed=3)}


def _cosines(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    return [float(F.cosine_similarity(x, y, dim=0)) for x, y in zip(a, b)]


@torch.no_grad()
def _bert_reference(folder: Path, texts: list[str], mode: str) -> list[torch.Tensor]:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.BertModel.from_pretrained(folder).eval()
    out = []
    for text in texts:
        hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
        out.append(F.normalize(hidden.mean(0) if mode == "mean" else hidden[0], dim=0))
    return out


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_bert_embeddings_equal_transformers(bert_dirs: dict[str, Path], mode: str):
    llm = LLM(str(bert_dirs[mode]), show_progress=False)
    outs = llm.embed(TEXTS)
    tok = transformers.AutoTokenizer.from_pretrained(bert_dirs[mode])
    assert [o.prompt_token_ids for o in outs] == [tok(t)["input_ids"] for t in TEXTS]
    ref = _bert_reference(bert_dirs[mode], TEXTS, mode)
    assert min(_cosines([o.outputs.data for o in outs], ref)) >= 0.9999
    assert all(abs(o.outputs.data.norm().item() - 1) < 1e-5 for o in outs)
    stats = llm.llm_engine.get_stats()
    assert stats.num_blocks_used == 0 and stats.num_running == 0


def test_prompts_of_one_step_are_batched_together(bert_dirs: dict[str, Path]):
    """Five prompts queued at once run in one step (one attention call, each prompt over its
    own rows) and equal the same prompts run alone."""
    llm = LLM(str(bert_dirs["mean"]), show_progress=False)
    engine = llm.llm_engine
    before = engine.num_steps
    together = llm.embed(TEXTS)
    assert engine.num_steps - before == 1
    alone = [llm.embed(t)[0] for t in TEXTS]
    assert min(_cosines([o.outputs.data for o in together],
                        [o.outputs.data for o in alone])) >= 0.99999


def test_token_budget_splits_a_batch_without_splitting_a_prompt(bert_dirs: dict[str, Path]):
    lengths = [len(o.prompt_token_ids)
               for o in LLM(str(bert_dirs["mean"]), show_progress=False).embed(TEXTS)]
    budget = max(lengths)
    llm = LLM(str(bert_dirs["mean"]), max_num_batched_tokens=budget, show_progress=False)
    engine = llm.llm_engine
    before = engine.num_steps
    outs = llm.embed(TEXTS)
    assert engine.num_steps - before >= -(-sum(lengths) // budget)
    ref = _bert_reference(bert_dirs["mean"], TEXTS, "mean")
    assert min(_cosines([o.outputs.data for o in outs], ref)) >= 0.9999
    with pytest.raises(ValueError, match=f"at most {budget}"):
        llm.embed(" ".join(["w1"] * budget))
    assert engine.get_stats().num_blocks_used == 0


def test_no_sentence_transformers_files_pools_cls_normalized(bert_dirs: dict[str, Path]):
    llm = LLM(str(bert_dirs["plain"]), show_progress=False)
    ref = _bert_reference(bert_dirs["plain"], TEXTS[:2], "cls")
    outs = llm.embed(TEXTS[:2])
    assert min(_cosines([o.outputs.data for o in outs], ref)) >= 0.9999


def test_matryoshka_dimensions_truncate_and_renormalize(bert_dirs: dict[str, Path]):
    llm = LLM(str(bert_dirs["mean"]), show_progress=False)
    full = llm.embed(TEXTS[1])[0].outputs.data
    short = llm.embed(TEXTS[1], PoolingParams(dimensions=16))[0].outputs.data
    assert short.shape == (16,)
    assert torch.allclose(short, F.normalize(full[:16], dim=0), atol=1e-6)
    raw = llm.embed(TEXTS[1], PoolingParams(normalize=False))[0].outputs.data
    assert abs(raw.norm().item() - 1) > 1e-3
    assert torch.allclose(F.normalize(raw, dim=0), full, atol=1e-6)
    with pytest.raises(ValueError, match="dimensions=65"):
        llm.embed("w1", PoolingParams(dimensions=65))
    # one PoolingParams per prompt, as vLLM's embed takes them
    both = llm.embed([TEXTS[1], TEXTS[1]], [PoolingParams(dimensions=16), PoolingParams()])
    assert torch.allclose(both[0].outputs.data, short, atol=1e-6)
    assert both[1].outputs.data.shape == full.shape
    with pytest.raises(TypeError, match="pooling_params takes a PoolingParams or a list"):
        llm.embed("w1", SamplingParams())  # type: ignore[arg-type]
    not_matryoshka = LLM(str(bert_dirs["cls"]), show_progress=False)
    with pytest.raises(ValueError, match="not supported by this model"):
        not_matryoshka.embed("w1", PoolingParams(dimensions=16))


@torch.no_grad()
def test_cross_encoder_scores_equal_transformers(bert_dirs: dict[str, Path]):
    folder = bert_dirs["cross"]
    llm = LLM(str(folder), show_progress=False)
    assert llm.llm_engine.task == "classify"
    with pytest.raises(ValueError, match="embed needs an embedding model"):
        llm.embed("w1")  # (its score is no embedding)
    query, docs = "what is w5", ["w5 is a word", "nothing here", "w5 w5 w5, again w5"]
    scores = [o.outputs.score for o in llm.score(query, docs)]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    ref = [torch.sigmoid(model(**tok(query, d, return_tensors="pt")).logits)[0, 0].item()
           for d in docs]
    assert scores == pytest.approx(ref, abs=1e-5)
    pair = llm.llm_engine.prepare_request(None, (query, docs[0]), PoolingParams())
    assert pair.children[0].token_type_ids == tok(query, docs[0])["token_type_ids"]
    probs = llm.classify(docs)
    assert [len(o.outputs.probs) for o in probs] == [1, 1, 1]
    with pytest.raises(ValueError, match="truncate_prompt_tokens applies to one text"):
        llm.score(query, docs, truncate_prompt_tokens=4)  # a pair is not cut


def test_embedding_model_scores_by_cosine(bert_dirs: dict[str, Path]):
    llm = LLM(str(bert_dirs["mean"]), show_progress=False)
    a, b = llm.embed(["w1 w2", "w3 w4"])
    [scored] = llm.score("w1 w2", "w3 w4")
    expected = float(F.cosine_similarity(a.outputs.data, b.outputs.data, dim=0))
    assert scored.outputs.score == pytest.approx(expected, abs=1e-6)
    assert len(llm.score(["w1", "w2"], ["w3", "w4"])) == 2
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score(["w1", "w2"], ["w3", "w4", "w5"])
    with pytest.raises(ValueError, match="classify needs a classifier"):
        llm.classify("w1 w2")  # (an embedding model's vectors are not label scores)
    # vLLM's keywords: truncate_prompt_tokens cuts each text, in score and in embed alike
    long_a, long_b = "w9 w8 w7 w1 w2", "w6 w5 w3 w4"
    [cut] = llm.score(long_a, long_b, truncate_prompt_tokens=4)
    [short] = llm.score("w1 w2", "w3 w4")
    assert cut.outputs.score == pytest.approx(short.outputs.score, abs=1e-6)  # [CLS] + 2 + [SEP]
    [embedded] = llm.embed(long_a, truncate_prompt_tokens=4)
    assert torch.allclose(embedded.outputs.data, a.outputs.data, atol=1e-6)


@pytest.fixture(scope="module")
def headless_qwen3(tmp_path_factory: pytest.TempPathFactory, smol_hf_dir: Path) -> Path:
    return save_headless_qwen3(tmp_path_factory.mktemp("qwen3-embed"), smol_hf_dir)


@torch.no_grad()
def _last_token_reference(model: torch.nn.Module, prompts: list[list[int]]
                          ) -> list[torch.Tensor]:
    return [F.normalize(model(torch.tensor([ids])).last_hidden_state[0, -1], dim=0)
            for ids in prompts]


def test_headless_decoder_embeds_by_its_last_token(headless_qwen3: Path):
    llm = LLM(str(headless_qwen3), kv_cache_memory="64MiB", show_progress=False)
    assert llm.llm_engine.task == "embed"
    prompts = [[5, 17, 300, 4000], list(range(100, 190)), [42] * 33]
    outs = llm.embed(prompts)
    ref = _last_token_reference(transformers.Qwen3Model.from_pretrained(headless_qwen3).eval(),
                                prompts)
    assert min(_cosines([o.outputs.data for o in outs], ref)) >= 0.9999
    assert llm.llm_engine.get_stats().num_blocks_used == 0
    with pytest.raises(ValueError, match="not text generation"):
        llm.generate("hello")


def test_causal_lm_embeds_with_task_embed(tiny_llama_dir: Path):
    llm = LLM(str(tiny_llama_dir), task="embed", kv_cache_memory="64MiB", show_progress=False)
    prompts = [[1, 2, 3, 4, 5], list(range(200, 260))]
    outs = llm.embed(prompts)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    ref = _last_token_reference(model.model, prompts)
    assert min(_cosines([o.outputs.data for o in outs], ref)) >= 0.9999


@pytest.mark.parametrize("task, match", [
    ("classify", "not a sequence classifier"), ("generate", "has no LM head"),
    ("summarize", "task must be one of")])
def test_a_task_the_checkpoint_cannot_serve_is_refused(bert_dirs: dict[str, Path], task: str,
                                                       match: str):
    with pytest.raises(ValueError, match=match):
        LLM(str(bert_dirs["mean"]), task=task, show_progress=False)


def test_generator_refuses_embeddings(smol_llm: LLM):
    with pytest.raises(ValueError, match="--task embed"):
        smol_llm.embed("hello")


def test_unknown_sentence_transformers_module_is_named(tmp_path: Path):
    import json

    folder = write_random_bert(tmp_path / "dense", SHAPE, "mean")
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense",
                    "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="models.Dense"):
        LLM(str(folder), show_progress=False)


def test_a_decoder_embeds_under_adapters(tiny_llama_dir: Path, tmp_path: Path):
    """A causal LM embedding (task=embed) with two LoRA adapters and none in one batch: each
    vector equals transformers' on the adapter merged into the weights."""
    from pkv.core.lora.adapter import LoRARequest
    from pkv.tests.helpers import make_lora_adapter

    merged = {name: make_lora_adapter(tiny_llama_dir, tmp_path / name, rank, targets, seed)
              for name, rank, targets, seed in [("a", 8, ["q_proj", "v_proj", "down_proj"], 1),
                                                ("b", 4, ["o_proj", "gate_proj"], 2)]}
    requests = {"a": LoRARequest("a", 1, str(tmp_path / "a")),
                "b": LoRARequest("b", 2, str(tmp_path / "b")), None: None}
    llm = LLM(str(tiny_llama_dir), task="embed", enable_lora=True, max_loras=2,
              kv_cache_memory="64MiB", show_progress=False)
    prompts = [[1, 2, 3, 4, 5], list(range(200, 260)), [7] * 20]
    names = ["a", None, "b", "b", "a", None]
    outs = llm.embed(prompts * 2, lora_request=[requests[n] for n in names])
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    refs = {n: _last_token_reference((merged[n] if n else base).model, prompts) for n in merged}
    refs[None] = _last_token_reference(base.model, prompts)
    want = [refs[n][i % 3] for i, n in enumerate(names)]
    assert min(_cosines([o.outputs.data for o in outs], want)) >= 0.9999
    assert max(_cosines(refs["a"], refs[None])) < 0.999  # the adapters matter
    # score under an adapter: the cosine of the adapter's vectors
    texts = ["the weather in Paris", "a cat sat on the mat"]
    [under_a] = llm.score(texts[0], texts[1], lora_request=requests["a"])
    a0, a1 = llm.embed(texts, lora_request=requests["a"])
    [plain] = llm.score(texts[0], texts[1])
    assert under_a.outputs.score == pytest.approx(
        float(F.cosine_similarity(a0.outputs.data, a1.outputs.data, dim=0)), abs=1e-5)
    assert abs(under_a.outputs.score - plain.outputs.score) > 1e-4
    assert llm.llm_engine.get_stats().num_blocks_used == 0


def test_a_decoder_pools_a_prompt_longer_than_a_step_in_chunks(tiny_llama_dir: Path):
    """Last-token pooling on a decoder: a prompt past the token budget runs in chunks as a
    prefill does (its K/V kept), pooled at its last chunk, beside prompts that fit a step;
    vectors equal transformers'. An encoder still takes at most one step's tokens."""
    llm = LLM(str(tiny_llama_dir), task="embed", kv_cache_memory="64MiB",
              max_num_batched_tokens=16, max_model_len=128, show_progress=False)
    prompts = [list(range(200, 300)), [1, 2, 3, 4, 5], list(range(300, 340))]
    outs = llm.embed(prompts)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    ref = _last_token_reference(model.model, prompts)
    assert min(_cosines([o.outputs.data for o in outs], ref)) >= 0.9999
    engine = llm.llm_engine
    assert engine.num_steps >= 100 // 16 and engine.get_stats().num_blocks_used == 0
    with pytest.raises(ValueError, match="takes at most 128"):
        llm.embed([list(range(200, 330))])


def test_an_encoder_takes_one_step_of_tokens(bert_dirs: dict[str, Path]):
    llm = LLM(str(bert_dirs["mean"]), max_num_batched_tokens=16, show_progress=False)
    with pytest.raises(ValueError, match="takes at most 16"):
        llm.embed([list(range(100, 120))])


def test_a_decoder_pooling_its_last_token_hits_the_prefix_cache(tiny_llama_dir: Path):
    """Inputs sharing an instruction (as Qwen3-Embedding's queries do): the later ones take
    its blocks from the prefix cache, a different salt (tenant) does not, and every vector
    equals transformers'."""
    llm = LLM(str(tiny_llama_dir), task="embed", kv_cache_memory="64MiB", show_progress=False)
    engine = llm.llm_engine
    instruction = list(range(500, 564))  # 4 blocks of 16
    prompts = [instruction + [7, 8, 9], instruction + list(range(600, 620))]
    first = llm.embed(prompts[:1])
    hits = engine.kv_cache.prefix_hits
    second = llm.embed(prompts[1:])
    assert engine.kv_cache.prefix_hits - hits == len(instruction)
    hits = engine.kv_cache.prefix_hits
    engine.add_request("other-tenant", prompts[1], PoolingParams(), cache_salt="tenant-b")
    salted = [o for o in engine.generate_until_done() if o.request_id == "other-tenant"]
    assert engine.kv_cache.prefix_hits == hits
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    ref = _last_token_reference(model.model, prompts)
    got = [first[0].outputs.data, second[0].outputs.data]
    assert min(_cosines(got, ref)) >= 0.9999
    assert _cosines([salted[0].outputs.data], ref[1:])[0] >= 0.9999
    assert second[0].num_cached_tokens == len(instruction)  # (it said 0)
    # embed() keeps a prompt dict's cache_salt (it dropped it, and read unsalted blocks)
    hits = engine.kv_cache.prefix_hits
    llm.embed([{"prompt_token_ids": prompts[1], "cache_salt": "tenant-c"}])
    assert engine.kv_cache.prefix_hits == hits


def test_a_tokenizer_files_own_truncation_and_padding_are_not_the_models(tmp_path: Path):
    # all-MiniLM-L6-v2's tokenizer.json truncates at 128 (sentence-transformers cuts at 256),
    # and some files pad to a fixed length: transformers ignores both, and so must pkv
    from tokenizers import Tokenizer as HFTokenizer

    folder = write_random_bert(tmp_path / "m", SHAPE, "mean", seed=4)
    backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    backend.enable_truncation(max_length=8)
    backend.enable_padding(length=8)
    backend.save(str(folder / "tokenizer.json"))
    long, short = TEXTS[1], "a"
    outs = LLM(str(folder), show_progress=False).embed([long, short])
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert [o.prompt_token_ids for o in outs] == [tok(t)["input_ids"] for t in (long, short)]
    assert len(outs[0].prompt_token_ids) > 8 and len(outs[1].prompt_token_ids) < 8
    ref = _bert_reference(folder, [long, short], "mean")
    assert min(_cosines([o.outputs.data for o in outs], ref)) >= 0.9999


def test_a_cross_encoder_scores_through_the_activation_its_config_names(tmp_path: Path):
    # ms-marco-MiniLM-L-6-v2 names Identity: sentence-transformers returns its raw logits
    import json

    folder = write_random_bert(tmp_path / "ce", SHAPE, classifier=True, seed=5)
    config = json.loads((folder / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (folder / "config.json").write_text(json.dumps(config))
    query, docs = "what is w5", ["w5 is a word", "nothing here"]
    scores = [o.outputs.score for o in LLM(str(folder), show_progress=False).score(query, docs)]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        ref = [model(**tok(query, d, return_tensors="pt")).logits[0, 0].item() for d in docs]
    assert scores == pytest.approx(ref, abs=1e-5)
