"""The pooling endpoints on real `pkv serve` processes: `/v1/embeddings` driven by the
official `openai` client (float and base64, `dimensions`) and raw HTTP (token ids, errors),
`/v1/rerank` and `/score` on a cross-encoder and on an embedding model, all against
transformers on the same random weights."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
import transformers

from pkv.cli.bench.embed import write_random_bert
from pkv.core.server.serving_pooling import json_body
from pkv.tests.server.conftest import RunningServer, start_server, stop_server
from pkv.tests.server.test_anthropic import _counter

SHAPE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
             vocab_size=1000, max_position_embeddings=128)
TEXTS = ["hello world", "w1 w2 w3 w4 w5 w6", "a, b and c!"]
QUERY, DOCS = "what is w5", ["nothing here", "w5 is a word", "w5 w5, again w5", "w7 w8"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling-models")
    return {"embed": write_random_bert(root / "embed", SHAPE, "mean", matryoshka=True),
            "cross": write_random_bert(root / "cross", SHAPE, classifier=True, seed=3),
            "classes": write_random_bert(root / "classes", SHAPE, classifier=True, seed=5,
                                         labels=3)}


def _serve(folder: Path, name: str, factory: pytest.TempPathFactory
           ) -> Iterator[RunningServer]:
    running = start_server(str(factory.mktemp(name)), str(folder), "--served-model-name", name,
                           "--max-model-len", "128")
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def embed_server(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[RunningServer]:
    yield from _serve(models["embed"], "embedder", tmp_path_factory)


@pytest.fixture(scope="module")
def cross_server(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[RunningServer]:
    yield from _serve(models["cross"], "reranker", tmp_path_factory)


@pytest.fixture(scope="module")
def classes_server(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[RunningServer]:
    yield from _serve(models["classes"], "classifier", tmp_path_factory)


def _hf_classifier(folder: Path) -> tuple[Any, Any]:
    """transformers' tokenizer and BertForSequenceClassification of `folder`."""
    return (transformers.AutoTokenizer.from_pretrained(folder),
            transformers.BertForSequenceClassification.from_pretrained(folder).eval())


@torch.no_grad()
def _reference(folder: Path, texts: list[str]) -> list[torch.Tensor]:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.BertModel.from_pretrained(folder).eval()
    return [F.normalize(model(**tok(t, return_tensors="pt")).last_hidden_state[0].mean(0), dim=0)
            for t in texts]


def _cos(a: list[float] | torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(torch.as_tensor(a, dtype=torch.float32), b, dim=0))


def _post(server: RunningServer, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60,
                      headers=kwargs.pop("headers", server.headers), **kwargs)


def test_openai_client_embeddings_equal_transformers(embed_server: RunningServer,
                                                     models: dict[str, Path]):
    client = openai.OpenAI(base_url=f"{embed_server.base_url}/v1", api_key=embed_server.api_key,
                           max_retries=0, timeout=60)
    ref = _reference(models["embed"], TEXTS)
    for fmt in ("float", "base64"):  # base64 asked for: the client hands back the string
        result = client.embeddings.create(model="embedder", input=TEXTS, encoding_format=fmt)
        assert [d.index for d in result.data] == [0, 1, 2]
        vectors = [np.frombuffer(base64.b64decode(d.embedding), "<f4").copy()
                   if fmt == "base64" else d.embedding for d in result.data]
        assert min(_cos(v, r) for v, r in zip(vectors, ref)) >= 0.9999
    # Not told, the client asks for base64 itself and decodes it.
    default = client.embeddings.create(model="embedder", input=TEXTS[0])
    assert _cos(default.data[0].embedding, ref[0]) >= 0.9999
    tok = transformers.AutoTokenizer.from_pretrained(models["embed"])
    tokens = sum(len(tok(t)["input_ids"]) for t in TEXTS)
    assert result.usage.prompt_tokens == result.usage.total_tokens == tokens
    short = client.embeddings.create(model="embedder", input=TEXTS[1], dimensions=16,
                                     encoding_format="float").data[0].embedding
    assert len(short) == 16 and abs(np.linalg.norm(short) - 1) < 1e-5
    assert _cos(short, F.normalize(ref[1][:16], dim=0)) >= 0.9999


def test_raw_http_base64_and_token_ids(embed_server: RunningServer, models: dict[str, Path]):
    floats = _post(embed_server, "/v1/embeddings", {"input": TEXTS[1]}).json()
    b64 = _post(embed_server, "/v1/embeddings",
                {"input": TEXTS[1], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    # JSON floats carry a float32's shortest digits (9 at most) and read back as the same one.
    assert np.array_equal(np.array(floats["data"][0]["embedding"], dtype=np.float32), decoded)
    assert max(_digits(x) for x in floats["data"][0]["embedding"]) <= 9
    assert floats["object"] == "list" and floats["model"] == "embedder"
    ids = transformers.AutoTokenizer.from_pretrained(models["embed"])(TEXTS[1])["input_ids"]
    for body in ({"input": ids}, {"input": [ids, ids]}):
        data = _post(embed_server, "/v1/embeddings", body).json()["data"]
        assert all(_cos(d["embedding"], torch.tensor(floats["data"][0]["embedding"])) > 0.99999
                   for d in data)


def test_truncate_prompt_tokens_keeps_the_last_tokens(embed_server: RunningServer,
                                                      models: dict[str, Path]):
    """vLLM's truncate_prompt_tokens: a text keeps [CLS], its last tokens and [SEP] (as the
    tokenizer truncating on the left gives them), ids keep their last N; -1 fits an over-long
    input to max_model_len instead of refusing it."""
    tok = transformers.AutoTokenizer.from_pretrained(models["embed"], truncation_side="left")
    text = " ".join(f"w{i}" for i in range(1, 30))
    for keep in (5, 12):
        got = _post(embed_server, "/v1/embeddings", {"input": text, "encoding_format": "float",
                                                     "truncate_prompt_tokens": keep}).json()
        assert got["usage"]["prompt_tokens"] == keep
        cut = tok.decode(tok(text, truncation=True, max_length=keep)["input_ids"],
                         skip_special_tokens=True)
        assert _cos(got["data"][0]["embedding"], _reference(models["embed"], [cut])[0]) >= 0.9999
    ids = tok(text)["input_ids"]
    by_ids = _post(embed_server, "/v1/embeddings", {"input": ids, "truncate_prompt_tokens": 3})
    assert by_ids.json()["usage"]["prompt_tokens"] == 3
    long = " ".join(["w1"] * 200)
    fitted = _post(embed_server, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": -1})
    assert fitted.status_code == 200 and fitted.json()["usage"]["prompt_tokens"] == 128
    for keep in (0, 2, "3"):  # 2: no room beside [CLS] and [SEP]
        r = _post(embed_server, "/v1/embeddings", {"input": text, "truncate_prompt_tokens": keep})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def _digits(x: float) -> int:
    return len(Decimal(repr(x)).normalize().as_tuple().digits)


def test_json_body_writes_float32_arrays_that_read_back_as_the_same_float32():
    rng = np.random.default_rng(0)
    values = np.concatenate([
        rng.standard_normal(20000),
        rng.standard_normal(20000) * 10.0 ** rng.integers(-44, 38, 20000),
        [0.0, -0.0, 1.0, 0.1, 1 / 3, 3.4e38, 1.2e-38, 1e-45]]).astype(np.float32)
    written = json.loads(json_body({"embedding": values, "index": 3}))
    assert written["index"] == 3
    assert np.array_equal(np.array(written["embedding"], dtype=np.float32), values)
    assert max(_digits(x) for x in written["embedding"]) <= 9
    # Widened as they are, the same values print 17 digits: a third more JSON.
    assert len(json.dumps(values.tolist())) > 1.3 * len(json_body({"embedding": values}))


@pytest.mark.parametrize("body, status, param", [
    ({"input": "w1", "dimensions": 0}, 400, "dimensions"),
    ({"input": "w1", "dimensions": 65}, 400, "dimensions"),
    ({"input": []}, 400, "input"),
    ({"input": " ".join(["w1"] * 200)}, 400, "input"),
    ({"input": [[5, 10**6]]}, 400, "input"),
    ({"input": "w1", "encoding_format": "hex"}, 400, "encoding_format"),
    ({"input": "w1", "model": "other"}, 404, "model"),
])
def test_bad_embedding_requests_name_the_field(embed_server: RunningServer, body: dict,
                                               status: int, param: str):
    r = _post(embed_server, "/v1/embeddings", body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_a_pooling_model_refuses_generation_and_needs_the_key(embed_server: RunningServer):
    r = _post(embed_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "task=embed" in r.json()["error"]["message"]
    hi = [{"role": "user", "content": "hi"}]
    for path, body in [("/v1/chat/completions", {"messages": hi}),
                       ("/v1/responses", {"input": "hi"}),
                       ("/v1/messages", {"model": "embedder", "max_tokens": 2, "messages": hi})]:
        r = _post(embed_server, path, body)
        error = r.json()["error"]
        assert r.status_code == 400 and "task=embed" in error["message"], (path, r.text)
    assert _post(embed_server, "/v1/embeddings", {"input": "w1"}, headers={}).status_code == 401
    metrics = httpx.get(embed_server.base_url + "/metrics", headers=embed_server.headers).text
    assert _counter(metrics, "/v1/embeddings", 200) >= 1
    assert _counter(metrics, "/v1/embeddings", 401) >= 1
    values = embed_server.metrics()
    assert values["pkv:num_requests_running"] == 0
    assert values["pkv:kv_blocks_free"] == values["pkv:kv_blocks_total"]


@torch.no_grad()
def test_rerank_and_score_on_a_cross_encoder(cross_server: RunningServer,
                                             models: dict[str, Path]):
    tok, model = _hf_classifier(models["cross"])
    ref = [torch.sigmoid(model(**tok(QUERY, d, return_tensors="pt")).logits)[0, 0].item()
           for d in DOCS]
    ranked = _post(cross_server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 3})
    body = ranked.json()
    assert [r["index"] for r in body["results"]] == sorted(range(4), key=lambda i: -ref[i])[:3]
    for r in body["results"]:
        assert r["relevance_score"] == pytest.approx(ref[r["index"]], abs=1e-5)
        assert r["document"]["text"] == DOCS[r["index"]]
    bare = _post(cross_server, "/rerank", {"query": QUERY, "documents": [{"text": DOCS[1]}],
                                           "return_documents": False}).json()
    assert "document" not in bare["results"][0] and bare["usage"]["total_tokens"] > 0
    scored = _post(cross_server, "/score", {"text_1": QUERY, "text_2": DOCS}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(ref, abs=1e-5)
    r = _post(cross_server, "/v1/embeddings", {"input": "w1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = _post(cross_server, "/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_2"
    r = _post(cross_server, "/v1/rerank", {"query": QUERY, "documents": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    every = _post(cross_server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0})
    assert len(every.json()["results"]) == len(DOCS)  # vLLM's 0: every document
    r = _post(cross_server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_n"
    for body, param in [({"documents": DOCS}, "query"), ({"query": 5, "documents": DOCS}, "query"),
                        ({"query": QUERY, "documents": DOCS, "truncate_prompt_tokens": 8},
                         "truncate_prompt_tokens")]:  # (a pair is not truncated)
        r = _post(cross_server, "/v1/rerank", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["message"].startswith(param)


@pytest.mark.parametrize("server_name", ["cross", "embed"])
def test_a_long_text_is_named_by_its_own_field(server_name: str, request: pytest.FixtureRequest):
    server = request.getfixturevalue(f"{server_name}_server")
    long = " ".join(["w1"] * 200)
    cases = [("/v1/rerank", {"query": QUERY, "documents": [*DOCS[:2], long]}, "documents[2]"),
             ("/v1/rerank", {"query": long, "documents": DOCS}, "query"),
             ("/score", {"text_1": [QUERY, long], "text_2": DOCS[:2]}, "text_1[1]"),
             ("/score", {"text_1": QUERY, "text_2": [long, DOCS[0]]}, "text_2[0]")]
    for path, body, name in cases:
        r = _post(server, path, body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["message"].startswith(f"{name}: "), r.text
        assert error["param"] == name.split("[")[0] and error["code"] == \
            "context_length_exceeded"
    values = server.metrics()
    assert values["pkv:kv_blocks_free"] == values["pkv:kv_blocks_total"]


@torch.no_grad()
def test_classify_gives_each_input_its_labels_scores(classes_server: RunningServer,
                                                     models: dict[str, Path]):
    tok, model = _hf_classifier(models["classes"])
    texts = [QUERY, *DOCS]
    body = _post(classes_server, "/classify", {"input": texts}).json()
    assert body["object"] == "list" and body["model"] == "classifier"
    assert body["usage"]["prompt_tokens"] == sum(len(tok(t).input_ids) for t in texts)
    for i, (row, text) in enumerate(zip(body["data"], texts)):
        probs = torch.softmax(model(**tok(text, return_tensors="pt")).logits[0], -1)
        assert row["index"] == i and row["num_classes"] == 3
        assert row["probs"] == pytest.approx(probs.tolist(), abs=1e-5)
        assert row["label"] == model.config.id2label[int(probs.argmax())]
    one = _post(classes_server, "/v1/classify", {"input": DOCS[1]}).json()["data"]
    assert one[0]["probs"] == pytest.approx(body["data"][2]["probs"], abs=1e-6)
    refused = _post(classes_server, "/classify", {"input": " ".join(["w1"] * 200)})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
    r = _post(classes_server, "/v1/embeddings", {"input": "w1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_classify_needs_a_classifier(embed_server: RunningServer):
    r = _post(embed_server, "/classify", {"input": "w1"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "model"
    assert "needs a sequence classifier (--task classify)" in error["message"]


def test_rerank_on_an_embedding_model_is_cosine(embed_server: RunningServer,
                                                models: dict[str, Path]):
    vectors = _reference(models["embed"], [QUERY, *DOCS])
    expected = [float(torch.dot(vectors[0], v)) for v in vectors[1:]]
    body = _post(embed_server, "/v1/rerank", {"query": QUERY, "documents": DOCS}).json()
    assert {r["index"]: r["relevance_score"] for r in body["results"]} == pytest.approx(
        dict(enumerate(expected)), abs=1e-4)
    # truncate_prompt_tokens cuts each text (vLLM's), in rerank and in score alike
    cut = {"truncate_prompt_tokens": 3}
    short = _post(embed_server, "/v1/rerank", {"query": QUERY, "documents": DOCS, **cut}).json()
    scored = _post(embed_server, "/score", {"text_1": QUERY, "text_2": DOCS, **cut}).json()
    assert short["usage"]["total_tokens"] == 3 * (1 + len(DOCS)) < body["usage"]["total_tokens"]
    assert sorted(r["relevance_score"] for r in short["results"]) == pytest.approx(
        sorted(d["score"] for d in scored["data"]), abs=1e-6)
    r = _post(embed_server, "/v1/rerank", {"query": "", "documents": DOCS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "query"  # not documents


def test_special_tokens_and_normalize_as_asked(embed_server: RunningServer):
    plain = _post(embed_server, "/v1/embeddings", {"input": TEXTS[1]}).json()
    bare = _post(embed_server, "/v1/embeddings", {"input": TEXTS[1],
                                                  "add_special_tokens": False}).json()
    assert bare["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] - 2  # [CLS], [SEP]
    raw = _post(embed_server, "/v1/embeddings", {"input": TEXTS[1], "dimensions": 16,
                                                 "normalize": False}).json()["data"][0]
    unit = _post(embed_server, "/v1/embeddings", {"input": TEXTS[1],
                                                  "dimensions": 16}).json()["data"][0]
    assert abs(float(np.linalg.norm(unit["embedding"])) - 1) < 1e-5
    assert abs(float(np.linalg.norm(raw["embedding"])) - 1) > 1e-3  # normalize=False wins
    assert _cos(raw["embedding"], torch.tensor(unit["embedding"])) > 0.99999


def test_a_decoder_embeds_under_an_adapter_named_as_the_model(tiny_llama_dir: Path,
                                                              tmp_path: Path):
    """`pkv serve --task embed --enable-lora --lora-modules a=...` on a causal LM: `model`
    names the adapter or the base model; the vectors equal transformers' on the adapter
    merged, and on the base; an unknown name is a 404 naming `model`."""
    from pkv.tests.helpers import make_lora_adapter
    from pkv.tests.models.test_pooling_models import _last_token_reference

    merged = make_lora_adapter(tiny_llama_dir, tmp_path / "a", 8, ["q_proj", "down_proj"], 5)
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    ids = [[1, 2, 3, 4, 5], list(range(200, 240))]
    server = start_server(str(tmp_path), str(tiny_llama_dir), "--task", "embed",
                          "--served-model-name", "base", "--max-model-len", "256",
                          "--enable-lora", "--lora-modules",
                          f"a={tmp_path / 'a'}")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                               max_retries=0)
        refs = {name: _last_token_reference(model.model, ids)
                for name, model in (("a", merged), ("base", base))}
        assert max(_cos(a, b) for a, b in zip(refs["a"], refs["base"])) < 0.999
        for name, want in refs.items():
            response = client.embeddings.create(model=name, input=ids)
            assert response.model == name
            assert min(_cos(g.embedding, w) for g, w in zip(response.data, want)) >= 0.9999
        score = _post(server, "/score", {"model": "a", "text_1": "w1 w2", "text_2": "w3"})
        assert score.status_code == 200
        missing = _post(server, "/v1/embeddings", {"model": "b", "input": "w1"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    finally:
        stop_server(server)
