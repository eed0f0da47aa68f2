"""Tenants by API key: each key works, and the prefix cache never shares a block between
tenants, not even with the same cache_salt; within one tenant it still hits."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pkv.tests.server.conftest import RunningServer, start_server, stop_server
from pkv.tests.server.test_http import MODEL

KEYS = ("tenant-a-key", "tenant-b-key-longer")
# Over two 16-token blocks, so a repeat can hit the cache.
PROMPT = ("Tenant isolation: the quick brown fox jumps over the lazy dog while seven wizards "
          "quietly hex every jump and the lazy dog sleeps on, dreaming of foxes and wizards.")


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(str(tmp_path_factory.mktemp("tenants")), api_key=",".join(KEYS))
    running.api_key = KEYS[0]  # for metrics()
    yield running
    stop_server(running)


def _complete(server: RunningServer, key: str, salt: str | None = None) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})


def _hits(server: RunningServer) -> float:
    return server.metrics()["pkv:prefix_cache_hits_total"]


@pytest.mark.parametrize("salt", [None, "shared-salt"])
def test_tenants_never_share_prefix_blocks(tenant_server: RunningServer, salt: str | None):
    a, b = KEYS
    first = _complete(tenant_server, a, salt)
    assert first.status_code == 200, first.text
    hits = _hits(tenant_server)
    other = _complete(tenant_server, b, salt)  # same prompt, same salt, other tenant
    assert other.status_code == 200, other.text
    assert _hits(tenant_server) == hits
    assert other.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    again = _complete(tenant_server, a, salt)  # the same tenant still reuses its blocks
    assert again.status_code == 200
    assert _hits(tenant_server) >= hits + 32


def test_the_operators_paths_take_the_first_key(tenant_server: RunningServer):
    # /admin/cache lists every tenant's requests; adapters serve every tenant
    def get(path: str, key: str) -> httpx.Response:
        return httpx.get(f"{tenant_server.base_url}{path}", timeout=60,
                         headers={"Authorization": f"Bearer {key}"})

    operator, tenant = KEYS
    for path in ("/admin/cache", "/admin/memory"):
        assert get(path, operator).status_code == 200
        refused = get(path, tenant)
        assert refused.status_code == 403 and "first API key" in refused.json()["error"]["message"]
    unload = httpx.post(f"{tenant_server.base_url}/v1/unload_lora_adapter", timeout=60,
                        json={"lora_name": "any"}, headers={"Authorization": f"Bearer {tenant}"})
    assert unload.status_code == 403
    assert get("/v1/models", tenant).status_code == 200  # the rest is every tenant's


def test_only_the_configured_keys_get_in(tenant_server: RunningServer):
    assert _complete(tenant_server, "tenant-c-key").status_code == 401
    assert _complete(tenant_server, ",".join(KEYS)).status_code == 401
    for key in KEYS:
        assert _complete(tenant_server, key).status_code == 200


def test_stored_responses_are_their_tenants_own(tenant_server: RunningServer):
    import openai

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{tenant_server.base_url}/v1", api_key=key,
                             max_retries=0, timeout=120)

    first = client(KEYS[0]).responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    assert client(KEYS[0]).responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.NotFoundError):
        client(KEYS[1]).responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client(KEYS[1]).responses.delete(first.id)
    assert client(KEYS[0]).responses.retrieve(first.id).id == first.id  # still its owner's
    with pytest.raises(openai.NotFoundError):
        client(KEYS[1]).responses.create(model=MODEL, input="And?", max_output_tokens=4,
                                         previous_response_id=first.id)
