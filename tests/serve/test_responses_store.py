"""The stored responses' bound: the least recently used goes first, a read refreshes one,
and size 0 keeps none (`--responses-store-size`)."""

from __future__ import annotations

import pytest

from kvserve.serve.responses_api.store import ResponseStore, StoredResponse


def stored(name: str) -> StoredResponse:
    return StoredResponse({"id": name}, [{"role": "user", "content": name}])


def test_the_least_recently_used_goes_first():
    store = ResponseStore(2)
    store.put("a", stored("a"))
    store.put("b", stored("b"))
    assert store.get("a") is not None  # a read: "a" is now the most recent
    store.put("c", stored("c"))
    assert store.get("b") is None and len(store) == 2
    assert store.get("a").body == {"id": "a"} and store.get("c") is not None
    assert store.delete("a") and not store.delete("a") and len(store) == 1


def test_size_zero_keeps_none_and_a_negative_size_is_refused():
    store = ResponseStore(0)
    store.put("a", stored("a"))
    assert store.get("a") is None and len(store) == 0
    with pytest.raises(ValueError, match="store size"):
        ResponseStore(-1)
