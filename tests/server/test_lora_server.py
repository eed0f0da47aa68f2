"""`pkv serve --enable-lora`: adapters chosen by `model`, listed with their parent, cycling
through fewer slots under concurrent load, and runtime load/unload only when enabled, behind
the API key and inside --lora-dir."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from pkv.tests.helpers import make_lora_adapter
from pkv.tests.server.conftest import RunningServer, start_server, stop_server

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "The three most useful things to pack for a long hike are"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, smol_hf_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(("a", "b", "c", "late")):
        make_lora_adapter(smol_hf_dir, root / name, 8 if i % 2 else 16, ALL, seed=20 + i)
    return root


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory,
                adapter_dir: Path) -> Iterator[RunningServer]:
    modules = [f"{n}={adapter_dir / n}" for n in ("a", "b", "c")]
    running = start_server(str(tmp_path_factory.mktemp("lora")), "--enable-lora",
                           "--max-loras", "2", "--lora-modules", *modules[:1], "--lora-modules",
                           modules[1], "--lora-modules", modules[2], "--enable-runtime-lora",
                           "--lora-dir", str(adapter_dir))
    yield running
    stop_server(running)


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                         max_retries=0, timeout=120)


def _complete(server: RunningServer, model: str) -> str:
    out = _client(server).completions.create(model=model, prompt=PROMPT, max_tokens=10,
                                             temperature=0)
    return out.choices[0].text


def test_models_lists_adapters_with_their_parent(lora_server: RunningServer):
    models = {m.id: m for m in _client(lora_server).models.list().data}
    base = next(m for m in models.values() if not getattr(m, "parent", None))
    assert {"a", "b", "c"} <= set(models)
    assert all(models[n].parent == base.id for n in ("a", "b", "c"))


def test_adapters_by_model_name_streamed_and_not_under_concurrency(lora_server: RunningServer):
    client = _client(lora_server)
    base = next(m.id for m in client.models.list().data if not getattr(m, "parent", None))
    names = [base, "a", "b", "c"]
    alone = {n: _complete(lora_server, n) for n in names}
    assert len(set(alone.values())) == len(names)  # every adapter changes the answer
    stream = list(client.completions.create(model="a", prompt=PROMPT, max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in stream if c.choices) == alone["a"]
    # Responses name the model asked for, as vLLM's do: the adapter, or the base.
    assert {c.model for c in stream} == {"a"}
    chat = client.chat.completions.create(model="b", max_tokens=2,
                                          messages=[{"role": "user", "content": PROMPT}])
    assert chat.model == "b"
    assert client.completions.create(model=base, prompt=PROMPT, max_tokens=1).model == base
    # Three adapters, two slots, everything at once: each answer as when alone.
    work = names * 2
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda n: _complete(lora_server, n), work))
    assert got == [alone[n] for n in work]
    metrics = lora_server.metrics()
    info = [k for k in metrics if k.startswith("pkv:lora_requests_info")]
    assert info and 'max_lora="2"' in info[0]
    assert metrics["pkv:kv_blocks_free"] == metrics["pkv:kv_blocks_total"]


def test_unknown_adapter_is_a_404_naming_model(lora_server: RunningServer):
    with pytest.raises(openai.NotFoundError) as info:
        _complete(lora_server, "nope")
    assert info.value.body["param"] == "model"


def test_runtime_load_and_unload(lora_server: RunningServer, adapter_dir: Path,
                                 tmp_path: Path):
    url = lora_server.base_url
    body = {"lora_name": "late", "lora_path": str(adapter_dir / "late")}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401
    outside = httpx.post(f"{url}/v1/load_lora_adapter", headers=lora_server.headers,
                         json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "lora_path"
    assert "--lora-dir" in outside.json()["error"]["message"]
    # a name under the folder that is no folder there (from inside it, "org/name" would
    # otherwise be a Hub id to fetch)
    missing = httpx.post(f"{url}/v1/load_lora_adapter", headers=lora_server.headers,
                         json={"lora_name": "x", "lora_path": str(adapter_dir / "org" / "name")})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    assert "load from that folder only" in missing.json()["error"]["message"]
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", headers=lora_server.headers, json=body)
    assert loaded.status_code == 200, loaded.text
    assert _complete(lora_server, "late")
    again = httpx.post(f"{url}/v1/load_lora_adapter", headers=lora_server.headers, json=body)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", headers=lora_server.headers,
                      json={"lora_name": "late"})
    assert gone.status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(lora_server, "late")


def test_runtime_loading_is_off_by_default(server: RunningServer, adapter_dir: Path):
    response = httpx.post(f"{server.base_url}/v1/load_lora_adapter", headers=server.headers,
                          json={"lora_name": "a", "lora_path": str(adapter_dir / "a")})
    assert response.status_code == 400
    assert "--enable-runtime-lora" in response.json()["error"]["message"]
