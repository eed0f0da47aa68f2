"""The Responses store: per tenant, bounded by count and by bytes (least recently used out
first) and by age (an expired response is gone, and no longer counted)."""

from __future__ import annotations

import time

from pkv.core.server.responses_api import ResponseStore, _Stored, _Turn


def _stored(response_id: str, age: float = 0.0) -> _Stored:
    return _Stored({"id": response_id}, _Turn([], []), time.time() - age)


def test_expired_responses_are_neither_read_nor_counted():
    store = ResponseStore(max_items=8, ttl=60.0)
    store.put("a", _stored("old", age=120.0))
    store.put("a", _stored("new"))
    assert len(store) == 1
    assert store.get("a", "old") is None and store.get("a", "new") is not None


def test_the_least_recently_used_goes_first_and_tenants_stay_apart():
    store = ResponseStore(max_items=2, ttl=60.0)
    store.put("a", _stored("r1"))
    store.put("a", _stored("r2"))
    assert store.get("a", "r1") is not None  # r1 used: r2 is now the oldest
    store.put("b", _stored("r3"))  # another tenant's: evicts nothing of a's
    assert store.get("a", "r2") is not None and store.get("a", "r1") is not None
    assert store.get("a", "r3") is None and store.get("b", "r3") is not None
    store.put("a", _stored("r4"))  # a's third: a's least recently used goes (r2: r1 read last)
    assert store.get("a", "r2") is None and store.get("a", "r1") is not None
    assert store.get("b", "r3") is not None and len(store) == 3 and store.capacity == 4


def _big(response_id: str, kib: int) -> _Stored:
    return _Stored({"id": response_id}, _Turn([{"role": "user", "content": "x" * kib * 1024}],
                                              []), time.time())


def test_bytes_bound_each_tenant_and_the_newest_is_kept():
    store = ResponseStore(max_items=100, ttl=60.0, max_bytes=320 * 1024)
    for i in range(3):
        store.put("a", _big(f"r{i}", 100))
    assert store.get("a", "r0") is not None and store.nbytes("a") < 320 * 1024
    store.put("a", _big("r3", 100))  # over the bound: the least recently used (r1) goes
    assert store.get("a", "r1") is None and store.get("a", "r0") is not None
    store.put("b", _big("huge", 1000))  # alone past the bound: kept, it is b's newest
    assert store.get("b", "huge") is not None and store.get("a", "r3") is not None
    store.put("a", _big("r3", 1))  # stored again (a final answer after in_progress)
    assert store.nbytes("a") < 210 * 1024
    assert store.delete("a", "r3") and store.delete("a", "r0") and store.delete("a", "r2")
    assert store.nbytes("a") == 0 and len(store) == 1
