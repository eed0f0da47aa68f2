"""Valid request bodies with one field of the wrong kind: where a body can be changed, and
values no field of any API takes all of (the soak sends such bodies; the server's mutation
test sends every one)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

REMOVED = object()  # the field taken out instead of replaced
WRONG_KINDS: list[Any] = [None, -1, 1.5, 2**63, "x", [], {}, [[1]],
                          {"type": "text", "text": 5}, REMOVED]


def places(body: Any, where: tuple = ()) -> Iterator[tuple]:
    """Every field and list element of a body, as a path of keys and indices (`model`
    aside: a wrong model is a 404 by design)."""
    if where:
        yield where
    children = body.items() if isinstance(body, dict) else \
        enumerate(body) if isinstance(body, list) else ()
    for key, value in children:
        if where + (key,) != ("model",):
            yield from places(value, where + (key,))


def mutated(body: dict[str, Any], where: tuple, value: Any) -> dict[str, Any]:
    """A copy of `body` with the field at `where` set to `value` (or removed)."""
    body = copy.deepcopy(body)
    parent = body
    for key in where[:-1]:
        parent = parent[key]
    if value is REMOVED:
        del parent[where[-1]]
    else:
        parent[where[-1]] = value
    return body
