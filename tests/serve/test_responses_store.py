"""The stored responses' bound: the least recently used goes first, a read refreshes one,
and size 0 keeps none (`--responses-store-size`); bytes bound it too (`--responses-store-mb`)."""

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


def test_bytes_bound_the_store_and_are_given_back():
    big = StoredResponse({"id": "x", "metadata": {"m": "v" * 4000}}, [])
    store = ResponseStore(100, max_mb=10_000 / 2**20)  # 10 kB: two such responses
    for name in "abc":
        store.put(name, StoredResponse(dict(big.body, id=name), []))
        assert store.bytes <= store.max_bytes
    assert store.get("a") is None and len(store) == 2
    assert store.delete("b") and store.bytes == store.get("c").size
    store.put("huge", StoredResponse({"id": "huge", "text": "h" * 20_000}, []))
    assert store.get("huge") is None and store.get("c") is not None  # heavier than the bound
    with pytest.raises(ValueError, match="megabytes"):
        ResponseStore(1, max_mb=-1)
