"""Stored responses: a least-recently-used map from id to response, bounded by count and bytes.

`store: true` (the default, as OpenAI's) keeps a response so that GET
/v1/responses/{id} returns it and `previous_response_id` continues its
conversation. The map is in memory and bounded twice: at most
`--responses-store-size` responses and `--responses-store-mb` megabytes, each
response weighed as its JSON (the body GET answers and the conversation it
carries on). The least recently used go first until both bounds hold; a response
heavier than the whole byte bound is not kept. So a long-running server's memory
does not grow with its traffic, nor with how much one client puts in a response.
Owned by the event loop: no lock.

Each stored response belongs to the key that made it (its `owner`): one server
has one API key, so every holder of the key is one owner, as every key of one
OpenAI project sees the project's stored responses.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

RESPONSES_STORE_SIZE = 1024
"""Stored responses kept by default (`--responses-store-size`)."""
RESPONSES_STORE_MB = 256
"""Megabytes of stored responses kept by default (`--responses-store-mb`)."""
MB = 1 << 20
ENTRY_OVERHEAD = 512
"""Bytes counted per response besides its JSON (the map's entry, the objects' headers)."""


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]
    """The response object as GET answers it."""
    conversation: list[dict[str, Any]]
    """The chat messages of the whole conversation, this response's answer last, without
    its instructions (a continuation gives its own)."""
    size: int = field(default=0, compare=False)
    """Its weight in bytes (set by the store)."""


def weigh(stored: StoredResponse) -> int:
    """Its JSON's length: what it holds, within a small factor of its Python objects."""
    return len(msgspec.json.encode([stored.body, stored.conversation])) + ENTRY_OVERHEAD


class ResponseStore:
    def __init__(self, capacity: int, max_mb: float = RESPONSES_STORE_MB) -> None:
        if capacity < 0:
            raise ValueError(f"the responses store size must be >= 0, got {capacity}")
        if max_mb < 0:
            raise ValueError(f"the responses store's megabytes must be >= 0, got {max_mb}")
        self.capacity = capacity
        self.max_bytes = int(max_mb * MB)
        self.bytes = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        stored.size = weigh(stored)
        self.delete(response_id)
        if stored.size > self.max_bytes:
            return
        self._items[response_id] = stored
        self.bytes += stored.size
        while len(self._items) > self.capacity or self.bytes > self.max_bytes:
            _, oldest = self._items.popitem(last=False)
            self.bytes -= oldest.size

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._items.pop(response_id, None)
        if stored is None:
            return False
        self.bytes -= stored.size
        return True
