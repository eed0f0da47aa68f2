"""Small HTTP helpers for commands that talk to a running server."""

from __future__ import annotations

from typing import Any


def base_url(url: str) -> str:
    """`http://host:port` from a URL given with or without `/v1`."""
    return url.rstrip("/").removesuffix("/v1")


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def get_metrics(url: str, headers: dict[str, str], timeout: float = 30) -> dict[str, float]:
    """A server's Prometheus /metrics as {sample name: value} (labels kept in the name)."""
    import httpx

    text = httpx.get(f"{url}/metrics", headers=headers, timeout=timeout).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def get_json(url: str, path: str, headers: dict[str, str], timeout: float = 30) -> Any:
    """GET `url + path` as JSON; a ValueError with one clear line if that fails."""
    import httpx

    try:
        r = httpx.get(f"{url}{path}", headers=headers, timeout=timeout)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise ValueError(f"cannot reach {url}: {exc}") from None
    if r.status_code != 200:
        raise ValueError(f"{url}{path} answered {r.status_code}: {r.text[:200]}")
    return r.json()
